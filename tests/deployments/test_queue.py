"""The live queue against a real ``prefect server start``: ``e31 scheduler``
and ``e31 worker`` processes (each worker its own scratch, told its node's
GPUs with E31_NODE_GPUS: this machine has none), jobs submitted with
``e31 submit``.  The works are small commands that record what they saw."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import stop_group

WORK = textwrap.dedent("""
    import json, os, pathlib, sys, time
    out = pathlib.Path(os.environ["E31_OUTPUT_DIR"])
    record = {"devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "node": os.environ.get("E31_NODE"),
              "start": time.time(), "pid": os.getpid()}
    (out / "started.json").write_text(json.dumps(record))
    time.sleep(float(sys.argv[1]))
    record["end"] = time.time()
    (out / "record.json").write_text(json.dumps(record))
""")


class Queue:
    """A pool on the session's Prefect server with its scheduler and workers."""

    def __init__(self, root: Path, nodes: dict[str, int]):
        self.root, self.name = root, f"q{uuid.uuid4().hex[:8]}"
        self.pool = root / "pool.yaml"
        self.pool.write_text(json.dumps({"pool_version": 1, "name": self.name, "nodes": [
            {"name": n, "gpus": g, "cpus": 2, "memory": "1GiB"} for n, g in nodes.items()]}))
        (root / "work.py").write_text(WORK)
        self.procs: dict[str, subprocess.Popen] = {}
        self.exe = str(Path(sys.executable).with_name("e31"))

    def start(self, what: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        log = open(self.root / f"{what}.log", "wb")
        proc = subprocess.Popen([self.exe, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})}, cwd=self.root)
        self.procs[what] = proc
        return proc

    def scheduler(self) -> None:
        self.start("scheduler", "scheduler", "--pool", str(self.pool), "--interval", "0.5")

    def worker(self, node: str, gpus: int) -> subprocess.Popen:
        return self.start(f"worker-{node}", "worker", "--pool", str(self.pool), "--node", node,
                          env={"E31_NODE_GPUS": str(gpus), "E31_SCRATCH": str(self.root / f"scratch-{node}")})

    def job(self, name: str, gpus: int, seconds: float, **request) -> Path:
        spec = self.root / f"{name}.yaml"
        spec.write_text(json.dumps({
            "name": name, "work": {"kind": "simulation", "command": [sys.executable, "work.py", str(seconds)]},
            "request": {"gpus": gpus, "cpus": 1, "duration": f"{seconds + 5}s", "limit": "5m", **request},
            "output": {"kind": "results", "url": str(self.root / "out" / name), "files": ["record.json"]}}))
        return spec

    def submit(self, spec: Path, *args: str) -> str:
        done = subprocess.run([self.exe, "submit", str(spec), "--pool", str(self.pool), *args], capture_output=True,
                              text=True, cwd=self.root)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def record(self, name: str) -> dict:
        return json.loads((self.root / "out" / name / "record.json").read_text())

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                stop_group(proc, timeout=20)


@contextmanager
def queue(tmp_path: Path, nodes: dict[str, int]):
    q = Queue(tmp_path, nodes)
    try:
        yield q
    finally:
        q.stop()


def wait_for(predicate, timeout: float = 180.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout:g} s")
        time.sleep(0.3)


def _done(q: Queue, *names: str) -> bool:
    return all((q.root / "out" / n / "manifest.json").exists() for n in names)


def test_gpu_jobs_share_a_node_without_overlap_and_see_only_their_devices(prefect_api, tmp_path):
    with queue(tmp_path, {"n1": 8}) as q:
        q.scheduler()
        q.worker("n1", 8)
        first, second, small = q.job("six-a", 6, 20), q.job("six-b", 6, 5), q.job("two", 2, 20)
        assert "start now on n1, GPUs 0,1,2,3,4,5" in q.submit(first)
        q.submit(second)
        q.submit(small)
        wait_for(lambda: _done(q, "six-a", "six-b", "two"), what="three jobs")
        a, b, two = q.record("six-a"), q.record("six-b"), q.record("two")
    assert b["start"] >= a["end"]  # the two 6-GPU jobs never overlap on the 8-GPU node
    assert two["start"] < a["end"] and a["start"] < two["end"]  # the 2-GPU job ran beside a 6-GPU one
    assert a["devices"] == b["devices"] == "0,1,2,3,4,5" and two["devices"] == "6,7"
    assert {a["node"], b["node"], two["node"]} == {"n1"}


def test_a_deadline_job_goes_before_a_long_job_that_has_slack(prefect_api, tmp_path):
    from datetime import datetime, timedelta, timezone

    with queue(tmp_path, {"n1": 4}) as q:
        q.scheduler()
        q.worker("n1", 4)
        q.submit(q.job("busy", 4, 8))
        wait_for(lambda: (q.root / "out").exists() and any((q.root / "scratch-n1").glob("busy/output/started.json")),
                 what="the first job to start")
        q.submit(q.job("long", 4, 30))
        deadline = (datetime.now(timezone.utc) + timedelta(seconds=60)).isoformat()
        q.submit(q.job("urgent", 4, 5, deadline=deadline))
        wait_for(lambda: _done(q, "busy", "long", "urgent"), timeout=240, what="three jobs")
        busy, long, urgent = q.record("busy"), q.record("long"), q.record("urgent")
    assert busy["end"] <= urgent["start"] < long["start"]
    assert urgent["end"] <= datetime.fromisoformat(deadline).timestamp()


def test_refusals_end_with_their_reason_and_a_failed_manifest(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client

    with queue(tmp_path, {"n1": 8}) as q:
        q.scheduler()
        out = q.submit(q.job("too-big", 9, 1))
        assert "refused: no node can hold 9 GPUs: the largest nodes have 8 GPUs" in out
        run_id = out.split("flow run ")[1].split()[0]
        with get_client(sync_client=True) as client:
            wait_for(lambda: client.read_flow_run(run_id).state.is_final(), what="the refusal")
            state = client.read_flow_run(run_id).state
    assert (state.type.value, state.message) == ("FAILED", "refused: no node can hold 9 GPUs: the largest nodes "
                                                           "have 8 GPUs")
    manifest = json.loads((tmp_path / "out" / "too-big" / "partial" / "manifest.json").read_text())
    assert (manifest["status"], manifest["files"]) == ("failed", [])
    assert manifest["message"] == "refused by the queue: no node can hold 9 GPUs: the largest nodes have 8 GPUs"


def test_a_waiting_job_says_why_in_its_state_and_in_e31_queue(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client

    with queue(tmp_path, {"n1": 8}) as q:
        q.scheduler()
        q.worker("n1", 8)
        first = q.submit(q.job("holder", 8, 20)).split("flow run ")[1].split()[0]
        wait_for(lambda: any((q.root / "scratch-n1").glob("holder/output/started.json")), what="the holder")
        waiting = q.submit(q.job("waiter", 6, 1)).split("flow run ")[1].split()[0]
        with get_client(sync_client=True) as client:
            wait_for(lambda: (client.read_flow_run(waiting).state.message or "").startswith("Queued: waiting"),
                     what="the reason")
            state = client.read_flow_run(waiting).state
        listed = subprocess.run([q.exe, "queue", "--pool", str(q.pool)], capture_output=True, text=True, cwd=q.root)
    reason = state.message.removeprefix("Queued: ")
    assert state.name == "Queued"
    assert reason.startswith(f"waiting for 6 GPUs on one node (0 free on n1); earliest start ")
    assert reason.endswith(f" UTC, after job holder ({first[:8]}) ends")
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["JOB", "RUN", "STATE", "NODE", "GPUS", "START", "REASON"]
    assert lines[1].split()[:5] == ["holder", first[:8], "Running", "n1", "0,1,2,3,4,5,6,7"]
    assert lines[1].endswith("running")
    assert lines[2].split()[:5] == ["waiter", waiting[:8], "Queued", "n1", "0,1,2,3,4,5"]
    assert lines[2].endswith(reason.split("; earliest")[0] + "; earliest" + reason.split("; earliest")[1]) \
        or "waiting for 6 GPUs on one node (0 free on n1)" in lines[2]
