"""The temporary Prefect server ``e31 run`` starts when no API is configured
(flows/tempserver.py): several at once on one fresh ``PREFECT_HOME``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


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


def test_two_runs_at_once_on_a_fresh_prefect_home_both_complete(tmp_path):
    """Both runs start their own temporary server on the same fresh home at
    the same moment; the second one's database creation used to fail
    (``duplicate column name: has_data``, exit code 3).  Now the first
    creation is serialised and both runs complete."""
    home = tmp_path / "prefect-home"  # fresh: no database yet
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home))
    exe = str(Path(sys.executable).with_name("e31"))
    procs = []
    try:
        for name in ("first", "second"):
            procs.append(subprocess.Popen(
                [exe, "run", str(_spec(tmp_path, name))], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, cwd=REPO, start_new_session=True,
                env={**env, "E31_SCRATCH": str(tmp_path / f"scratch-{name}")}))
        results = [proc.communicate(timeout=400) for proc in procs]
    finally:
        for proc in procs:  # a run left behind by a failed assertion or a timeout: its group (and server) goes
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for name, proc, (stdout, stderr) in zip(("first", "second"), procs, results):
        assert proc.returncode == 0, f"{name}: {stderr}"
        manifest = json.loads((tmp_path / f"out-{name}" / "manifest.json").read_text())
        assert (manifest["job"], manifest["status"], manifest["reason"]) == (name, "completed", "finished")
        assert (tmp_path / f"out-{name}" / "done.txt").read_text() == "done"
    assert (home / ".e31-db.lock").exists() and (home / ".e31-db-ready").exists()
