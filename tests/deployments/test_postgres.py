"""The queue on a Prefect server backed by PostgreSQL, the set-up beyond one machine (docs/queue.md).

A private PostgreSQL cluster (Debian's package, :mod:`tests.pgserver`), a ``prefect server start``
on it, ``e31 scheduler`` and one ``e31 worker``; jobs submitted with ``e31 submit``.  One scenario,
so that the server's first start on a new database (its migrations) is paid once.  Needs root and
Debian's ``postgresql`` (``.ci/run`` installs it); skips and says why otherwise.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e31.deployments.scheduler import HISTORY_EVERY_S
from e31.prefect_compat.api import api_ready
from tests.conftest import final_manifest, stop_group
from tests.pgserver import postgres, unavailable

pytestmark = pytest.mark.server  # it starts servers of its own

E31 = str(Path(sys.executable).with_name("e31"))

WORK = """
import json, os, pathlib, sys, time
out, signals = pathlib.Path(os.environ["E31_OUTPUT_DIR"]), pathlib.Path(sys.argv[1])
(signals / f"{sys.argv[2]}-{os.getpid()}.started").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
while not (signals / "go").exists():
    time.sleep(0.1)
(out / "record.json").write_text(json.dumps({"pid": os.getpid(), "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}))
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, logs: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(logs.glob("*.log")))
            raise AssertionError(f"{what} not reached in {timeout:g} s\n{tails}")
        time.sleep(0.3)


def test_the_queue_runs_on_prefect_over_postgresql_and_through_a_database_restart(tmp_path):
    """Two jobs placed side by side on one 8-GPU node; PostgreSQL restarted (every connection of the
    server dropped) while both run; both then return their outputs, and a job submitted after the
    restart runs too: the scheduler and the worker carry on, and no job ran twice or shared a GPU.
    With PostgreSQL stopped (longer than the scheduler's history re-read, which used to end it),
    ``e31 queue`` fails at once in one line naming the server's database setting,
    and works again once it is back."""
    why = unavailable()
    if why:
        pytest.skip(why)
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": api,
                "PREFECT_SERVER_UI_API_URL": api, "PREFECT_UI_ENABLED": "false",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
                "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL"})
    signals = tmp_path / "signals"
    signals.mkdir()
    (tmp_path / "work.py").write_text(WORK)
    pool = tmp_path / "pool.yaml"
    pool.write_text(json.dumps({"pool_version": 1, "name": f"pg-{port}", "nodes": [
        {"name": "n1", "gpus": 8, "cpus": 2, "memory": "1GiB"}]}))
    procs: list[subprocess.Popen] = []

    def start(name: str, argv: list[str], extra: dict | None = None) -> subprocess.Popen:
        with open(tmp_path / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**env, **(extra or {})}, cwd=tmp_path)
        procs.append(proc)
        return proc

    def submit(name: str) -> None:
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(json.dumps({
            "name": name, "work": {"kind": "simulation", "command": [sys.executable, "work.py", str(signals), name]},
            "request": {"gpus": 4, "cpus": 1, "duration": "30s", "limit": "5m"},
            "output": {"kind": "results", "url": str(tmp_path / "out" / name), "files": ["record.json"]}}))
        done = subprocess.run([E31, "submit", str(spec), "--pool", str(pool)], capture_output=True, text=True,
                              env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr

    def started(name: str) -> list[Path]:
        return list(signals.glob(f"{name}-*.started"))

    with postgres() as pg:
        try:
            server = start("prefect-server", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                              "--port", str(port)], {"PREFECT_SERVER_DATABASE_CONNECTION_URL": pg.url})
            wait_for(lambda: api_ready(api) or server.poll() is not None, 300, "the Prefect server on PostgreSQL",
                     tmp_path)
            assert server.poll() is None, (tmp_path / "prefect-server.log").read_text()[-3000:]
            scheduler = start("scheduler", [E31, "scheduler", "--pool", str(pool), "--interval", "0.5"])
            start("worker", [E31, "worker", "--pool", str(pool), "--node", "n1"],
                  {"E31_NODE_GPUS": "8", "E31_SCRATCH": str(tmp_path / "scratch")})
            submit("first")
            submit("second")
            wait_for(lambda: started("first") and started("second"), 240, "both jobs running", tmp_path)
            pg.restart()  # every connection of the Prefect server is dropped
            (signals / "go").touch()
            wait_for(lambda: all(final_manifest(tmp_path / "out" / n) for n in ("first", "second")), 240,
                     "both outputs returned after the restart", tmp_path)
            submit("third")
            wait_for(lambda: final_manifest(tmp_path / "out" / "third"), 240, "a job submitted after the restart",
                     tmp_path)
            pg.stop()  # the server stays up, its database is gone: a command says which setting to check
            wait_for(lambda: "tick failed (DatabaseUnavailable: " in (tmp_path / "scheduler.log").read_text(), 60,
                     "the scheduler to name the database", tmp_path)
            away = time.monotonic()  # an outage longer than the scheduler's history re-read: it must carry on
            wait_for(lambda: time.monotonic() - away > HISTORY_EVERY_S + 5 or scheduler.poll() is not None,
                     HISTORY_EVERY_S + 30, "an outage past the history re-read", tmp_path)
            assert scheduler.poll() is None, (tmp_path / "scheduler.log").read_text()[-3000:]
            said = (tmp_path / "scheduler.log").read_text()  # the same failure again: a count, not the whole line
            assert re.search(r"^\d\d:\d\d:\d\d e31 scheduler: tick failed \(DatabaseUnavailable, again: 2 in a row "
                             r"since \d\d:\d\d:\d\d\); next tick in 0.5 s$", said, re.M), said[-3000:]
            began = time.monotonic()
            down = subprocess.run([E31, "queue", "--pool", str(pool)], capture_output=True, text=True, env=env,
                                  cwd=tmp_path, timeout=120)
            down_s = time.monotonic() - began
            slash = subprocess.run([E31, "queue", "--pool", str(pool)], capture_output=True, text=True,  # a URL
                                   env={**env, "PREFECT_API_URL": api + "/"}, cwd=tmp_path, timeout=120)  # ending in /
            pg.start()
            wait_for(lambda: "ticks go through again" in (tmp_path / "scheduler.log").read_text(), 120,
                     "the scheduler's ticks to go through again", tmp_path)
            answers: list[subprocess.CompletedProcess] = []

            def clean() -> bool:  # the scheduler's claim and the worker's heartbeat renewed after the outage
                answers.append(subprocess.run([E31, "queue", "--pool", str(pool)], capture_output=True, text=True,
                                              env=env, cwd=tmp_path, timeout=120))
                return answers[-1].returncode == 0 and answers[-1].stderr == "" and "late:" not in answers[-1].stdout

            wait_for(clean, 120, "e31 queue to find the scheduler and the worker heard again", tmp_path)
            back = answers[-1]
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    stop_group(proc, timeout=20)
    assert (down.returncode, down.stdout, down.stderr) == (1, "", (
        f"e31: the Prefect server at {api} answers, but its database does not: check the database named by the "
        "server's PREFECT_SERVER_DATABASE_CONNECTION_URL (is PostgreSQL running and reachable? pg_isready) and "
        "retry\n"))
    said = (tmp_path / "scheduler.log").read_text()
    assert (f"tick failed (DatabaseUnavailable: the Prefect server at {api} answers, but its database does not: "
            "check the database named by the server's PREFECT_SERVER_DATABASE_CONNECTION_URL") in said, said[-3000:]
    assert (slash.returncode, slash.stderr) == (1, (
        f"e31: the Prefect server at {api}/ answers, but its database does not: check the database named by the "
        "server's PREFECT_SERVER_DATABASE_CONNECTION_URL (is PostgreSQL running and reachable? pg_isready) and "
        "retry\n"))
    assert down_s < 20  # asked once (GET /api/ready), not after ~2 min of the client's retries: a bound, not a speed
    assert (back.returncode, back.stderr, back.stdout.split()[:3]) == (0, "", ["JOB", "RUN", "STATE"]), back.stdout
    for name in ("first", "second", "third"):
        assert final_manifest(tmp_path / "out" / name)["status"] == "completed", name
        (once,) = started(name)  # started exactly once
        record = json.loads((tmp_path / "out" / name / "record.json").read_text())
        assert record["pid"] == int(once.name.split("-")[1].split(".")[0])
    devices = [set(json.loads((tmp_path / "out" / n / "record.json").read_text())["devices"].split(","))
               for n in ("first", "second")]
    assert len(devices[0]) == len(devices[1]) == 4 and not devices[0] & devices[1]  # never a GPU shared
