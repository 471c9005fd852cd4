"""The Prefect server killed mid-job: E31 finishes the job from what it
knows (the work, its checkpoints, the return), ``e31 run`` exits with the
manifest's code instead of hanging in the client's retries, and the flow
run gets the manifest's state once a server answers again.  A real
``prefect server start`` of its own, killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import _free_port, stop_group

HERE = Path(__file__).resolve().parent


def _server(home: Path, port: int) -> subprocess.Popen:
    from e31.prefect_compat.api import api_ready

    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while not api_ready(f"http://127.0.0.1:{port}/api"):
        assert proc.poll() is None and time.monotonic() < deadline, "prefect server did not start"
        time.sleep(0.5)
    return proc


def _committed(out: Path) -> list[Path]:
    """The committed checkpoints at the destination (old ones are pruned as new ones land)."""
    return sorted((out / "checkpoints").glob("step-*/COMMITTED"))


@pytest.mark.server  # starts and kills a Prefect server of its own
def test_a_server_killed_mid_job_leaves_the_job_whole_and_its_state_set_later(tmp_path, scratch):
    port, home = _free_port(), tmp_path / "prefect-home"
    api = f"http://127.0.0.1:{port}/api"
    servers = [_server(home, port)]
    e31 = None
    try:
        spec = tmp_path / "job.yaml"
        spec.write_text(json.dumps({
            "name": "outlives-api", "work": {"kind": "simulation", "entrypoint": "stopwork:steps",
                                             "params": {"n": 40, "step_s": 0.25}},
            "request": {"limit": "5m", "grace": "2s"},
            "output": {"kind": "results", "url": str(tmp_path / "out"), "files": ["done.txt"]}}))
        env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(home), "E31_SCRATCH": str(scratch),
               "PYTHONPATH": str(HERE)}
        e31 = subprocess.Popen([str(Path(sys.executable).with_name("e31")), "run", str(spec)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        out = tmp_path / "out"
        deadline = time.monotonic() + 180
        while not _committed(out):  # a checkpoint has landed (stays true: one is always kept)
            assert e31.poll() is None and time.monotonic() < deadline, \
                e31.stderr.read() if e31.poll() is not None else "no checkpoint within 180 s"
            time.sleep(0.2)
        os.killpg(servers[0].pid, signal.SIGKILL)
        servers[0].wait()
        stdout, stderr = e31.communicate(timeout=240)
        done_at = time.time()
        manifest = json.loads((out / "manifest.json").read_text())
        assert e31.returncode == 0, stderr
        assert (manifest["status"], manifest["step"]) == ("completed", 40)  # the work went on, checkpoints too
        assert (out / "checkpoints" / "step-40" / "COMMITTED").is_file()
        returned_at = (out / "manifest.json").stat().st_mtime
        assert done_at - returned_at < 90, done_at - returned_at  # left soon after the output was returned
        assert stdout.startswith(f"completed (finished): outlives-api -> {out}")
        assert "the flow run's state is set to what the manifest says when an API answers again" in stderr
        record = json.loads((scratch / "outlives-api" / "flow-run-state.json").read_text())
        assert record == {"run_id": manifest["run_id"], "type": "COMPLETED", "name": "Completed",
                          "message": "completed (finished)"}

        servers.append(_server(home, port))  # the same database: the run is there, still Running
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from e31.prefect_compat.statesync import apply_pending

        with temporary_settings(updates={PREFECT_API_URL: api}):
            assert apply_pending(scratch) == [manifest["run_id"]]
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(manifest["run_id"]).state
        assert (state.type.value, state.name) == ("COMPLETED", "Completed")
        assert not (scratch / "outlives-api" / "flow-run-state.json").exists()
    finally:  # whatever the outcome: no server or run of this test is left behind
        if e31 is not None and e31.poll() is None:
            stop_group(e31)
        for server in servers:
            if server.poll() is None:
                stop_group(server)
