"""The temporary Prefect server ``e31 run`` starts when no API is configured
(e31/prefect_compat/tempserver.py): several at once on one fresh ``PREFECT_HOME``."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e31.prefect_compat.api import api_ready
from tests.conftest import REPO

WAITING = "e31: waiting for another temporary Prefect server to set up the database in "


def _spec(folder: Path, name: str) -> Path:
    out = folder / f"out-{name}"
    path = folder / f"{name}.json"
    path.write_text(json.dumps({
        "name": name, "work": {"kind": "processing", "command": [
            sys.executable, "-c", "import os, pathlib; pathlib.Path(os.environ['E31_OUTPUT_DIR'], 'done.txt')"
                                  ".write_text('done')"]},
        "request": {"limit": "5m"},
        "output": {"kind": "files", "url": str(out), "files": ["done.txt"]}}))
    return path


def _server_child(pid: int) -> int | None:
    """The pid of the ``prefect server start`` that process ``pid`` started, if any yet."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"server" in cmdline and b"start" in cmdline:
            return int(entry.name)
    return None


def _migrated_once(db: Path) -> bool:
    """Whether a server has committed at least one migration to ``db`` (its
    ``alembic_version`` has a row): it is in the middle of creating it."""
    if not db.exists():
        return False
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=0.1) as conn:
            return conn.execute("SELECT count(*) FROM alembic_version").fetchone()[0] > 0
    except sqlite3.Error:
        return False


@pytest.mark.server  # two `e31 run`s each start a temporary Prefect server
def test_two_runs_at_once_on_a_fresh_prefect_home_both_complete(tmp_path):
    """Both runs start their own temporary server on the same fresh home;
    the second one's database creation used to fail (``duplicate column
    name: has_data``, exit code 3) when it started while the first was
    migrating.  To make that overlap happen every time, each server is
    frozen (SIGSTOP) as soon as it is spawned, before it imports Prefect;
    the first is thawed and frozen again once it has committed its first
    migration, the second is thawed until it has started or failed, and then
    the first goes on.  With the lock the second run waits for the first's
    server instead (it says so) and spawns none meanwhile: both complete."""
    home = tmp_path / "prefect-home"  # fresh: no database yet
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home))
    exe = str(Path(sys.executable).with_name("e31"))
    names = ("first", "second")
    procs, frozen = [], {}
    try:
        for name in names:
            with open(tmp_path / f"{name}.err", "w") as err, open(tmp_path / f"{name}.out", "w") as out:
                procs.append(subprocess.Popen(
                    [exe, "run", str(_spec(tmp_path, name))], stdout=out, stderr=err, cwd=REPO,
                    start_new_session=True, env={**env, "E31_SCRATCH": str(tmp_path / f"scratch-{name}")}))
        deadline = time.monotonic() + 240
        while True:
            for i, proc in enumerate(procs):
                child = _server_child(proc.pid) if i not in frozen else None
                if child is not None:
                    os.kill(child, signal.SIGSTOP)
                    frozen[i] = child
            waiting = [i for i, name in enumerate(names)
                       if i not in frozen and WAITING in (tmp_path / f"{name}.err").read_text()]
            if frozen and len(frozen) + len(waiting) == len(procs):
                break
            assert all(proc.poll() is None for proc in procs), "an e31 run ended before its server started"
            assert time.monotonic() < deadline, "no temporary server was started"
            time.sleep(0.01)
        first = min(frozen)  # the run whose server creates the database
        os.kill(frozen[first], signal.SIGCONT)
        if len(frozen) == 2:  # both servers were spawned: the second starts while the first migrates
            second = 1 - first
            while not _migrated_once(home / "prefect.db"):
                assert time.monotonic() < deadline and procs[first].poll() is None, "the first server made no database"
                time.sleep(0.01)
            os.kill(frozen[first], signal.SIGSTOP)  # held mid-way through its migrations ...
            os.kill(frozen[second], signal.SIGCONT)  # ... while the second server sets the database up too
            url = re.search(r"on (http://\S+/api)", (tmp_path / f"{names[second]}.err").read_text()).group(1)
            while procs[second].poll() is None and not api_ready(url, timeout_s=0.5):
                assert time.monotonic() < deadline, "the second server neither started nor failed"
                time.sleep(0.05)
            os.kill(frozen[first], signal.SIGCONT)  # and the first goes on from where it was
        for proc in procs:
            proc.wait(timeout=400)
    finally:
        for child in frozen.values():
            try:
                os.kill(child, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for proc in procs:  # a run left behind by a failed assertion or a timeout: its group (and server) goes
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for name, proc in zip(names, procs):
        assert proc.returncode == 0, f"{name}: {(tmp_path / f'{name}.err').read_text()}"
        manifest = json.loads((tmp_path / f"out-{name}" / "manifest.json").read_text())
        assert (manifest["job"], manifest["status"], manifest["reason"]) == (name, "completed", "finished")
        assert (tmp_path / f"out-{name}" / "done.txt").read_text() == "done"
    assert len(frozen) == 1  # one server set the database up while the other run waited
    assert (home / ".e31-db-ready").exists()
