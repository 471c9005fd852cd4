"""The queue on a Prefect server with basic auth (``PREFECT_SERVER_API_AUTH_STRING``): every ``e31``
command works with the client's ``PREFECT_API_AUTH_STRING``; a missing or wrong string gets one line
naming the setting; the string never reaches a log, an output or an error (a real server of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import _free_port, final_manifest, stop_group
from tests.deployments.test_queue import queue, wait_for

pytestmark = [pytest.mark.server, pytest.mark.slow]

SECRET = "operator:Zq7-not-in-any-log"


def test_the_queue_works_behind_basic_auth_and_a_wrong_string_gets_one_line(tmp_path, monkeypatch):
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    log = open(tmp_path / "auth-server.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_UI_ENABLED": "false",
             "PREFECT_SERVER_API_AUTH_STRING": SECRET})
    try:
        wait_for(lambda: _healthy(api), timeout=120, what="the server with basic auth")
        monkeypatch.setenv("PREFECT_API_URL", api)
        with queue(tmp_path, {"n1": 0}) as q:
            monkeypatch.delenv("PREFECT_API_AUTH_STRING", raising=False)
            missing = _e31(q, "queue", "--pool", str(q.pool))
            monkeypatch.setenv("PREFECT_API_AUTH_STRING", "operator:wrong")
            wrong = _e31(q, "submit", str(q.job("j1", 0, 1)), "--pool", str(q.pool))
            deployed = _e31(q, "deploy", str(q.job("j1", 0, 1)), "--pool", str(q.pool))
            worker = _e31(q, "worker", "--pool", str(q.pool), "--node", "n1")  # it stops at its first request
            monkeypatch.setenv("PREFECT_API_AUTH_STRING", SECRET)
            q.scheduler()
            q.worker("n1", 0)
            submitted = _e31(q, "submit", str(q.job("j1", 0, 1)), "--pool", str(q.pool))
            wait_for(lambda: final_manifest(q.root / "out" / "j1") is not None, what="j1's output")
            listed = _e31(q, "queue", "--pool", str(q.pool))
            used = _e31(q, "usage", "--pool", str(q.pool), "--json")
            logs = {p.name: p.read_text(errors="replace") for p in tmp_path.glob("*.log")}
    finally:
        stop_group(server)
        log.close()
    line = (f"e31: the Prefect server at {api} requires basic auth and PREFECT_API_AUTH_STRING {{}}: set "
            "PREFECT_API_AUTH_STRING to the user:password of the server's PREFECT_SERVER_API_AUTH_STRING\n")
    assert (missing.returncode, missing.stdout, missing.stderr) == (1, "", line.format("is not set"))
    assert (wrong.returncode, wrong.stdout, wrong.stderr) == (1, "", line.format("is set but the server refused it"))
    assert (deployed.returncode, deployed.stdout, deployed.stderr) == (
        1, "", line.format("is set but the server refused it").replace("e31: ", "e31: deploy failed: ", 1))
    assert worker.returncode == 1 and worker.stderr.splitlines()[-1] == line.format(
        "is set but the server refused it").rstrip("\n"), worker.stderr
    assert submitted.returncode == 0 and listed.returncode == 0, (submitted.stderr, listed.stderr)
    assert json.loads(used.stdout)["total"]["completed"] == 1
    for what, text in {**logs, "outputs": "".join(p.stdout + p.stderr for p in (missing, wrong, deployed, worker, submitted,
                                                                                    listed, used))}.items():
        assert "Zq7-not-in-any-log" not in text, what


def _healthy(api: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{api}/health", auth=tuple(SECRET.split(":", 1)), timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _e31(q, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([q.exe, *args], capture_output=True, text=True, cwd=q.root, timeout=120)
