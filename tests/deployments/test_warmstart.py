"""The worker's warm flow process (``e31.deployments.warmstart``) and its
client, as real processes: fd handover (standard input; the fork writes to
the warm process's own output), exit status, signals, the cold
fallback, a killed client, the end of the warm process.

The Prefect API here is a frozen server (a socket that accepts and never
answers), so a forked engine run blocks in its first API call for as long
as a test needs.  Runs that reach a real server go through the whole queue
in ``test_queue.py``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from e31.deployments import warmstart_client

CLIENT = Path(warmstart_client.__file__)


def _wait(cond, timeout: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def warm(tmp_path):
    """A warm process whose Prefect API is a frozen server; yields
    (process, socket path, its environment)."""
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(64)
    env = {**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{frozen.getsockname()[1]}/api"}
    path = str(tmp_path / "warm.sock")
    output = tmp_path / "warm.out"  # as e31 worker's own output: where the forked runs write
    proc = subprocess.Popen([sys.executable, "-m", "e31.deployments.warmstart", path], env=env, stdin=subprocess.PIPE,
                            stdout=open(output, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    proc.output = output
    _wait(lambda: os.path.exists(path) or proc.poll() is not None, what="the warm process to listen")
    assert proc.poll() is None
    yield proc, path, env
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    frozen.close()


def _client(path: str, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-S", str(CLIENT), path], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)


def _children(proc: subprocess.Popen) -> list[int]:
    """The pids of ``proc``'s children (its forked runs)."""
    return [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]


def _raw_request(path: str, env: dict) -> tuple[socket.socket, int, int]:
    """Send a request as the client does, with a pipe as the child's stderr;
    returns (connection, read end of that pipe, the client side's copy of it)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    r, w = os.pipe()
    header = json.dumps({"env": env, "cwd": "/"}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(header))], [0, w, w])
    conn.sendall(header)
    os.close(w)
    return conn, r, w


def _lines(conn: socket.socket) -> list[str]:
    conn.settimeout(60)
    data = b""
    while chunk := conn.recv(4096):
        data += chunk
    return data.decode().splitlines()


def test_a_forked_run_gets_the_clients_environment_and_its_exit_status_and_writes_to_the_worker_s_output(warm):
    """The fork runs with the client's environment (its bad flow run id) and
    reports its exit status; it writes to the warm process's output (the
    worker's own), not to the client's stderr: a pipe to Prefect's worker,
    which has no reader once the worker is killed."""
    proc, path, env = warm
    conn, r, _ = _raw_request(path, {**env, "PREFECT__FLOW_RUN_ID": "not-a-run-id"})
    lines = _lines(conn)
    err = b""
    while chunk := os.read(r, 65536):
        err += chunk
    assert len(lines) == 2 and lines[0].startswith("pid ") and int(lines[0].split()[1]) not in (os.getpid(), proc.pid)
    assert lines[1] == "exit 1"  # prefect.engine's own exit for a bad flow run id
    import prefect.engine

    assert err == b""
    assert f"Invalid flow run id. Received arguments: [{prefect.engine.__file__!r}]" in proc.output.read_text()


def test_the_client_ends_as_its_forked_run_ends(warm):
    proc, path, env = warm
    client = _client(path, {**env, "PREFECT__FLOW_RUN_ID": "not-a-run-id"})
    out, err = client.communicate(timeout=60)
    assert client.returncode == 1
    assert (out, err) == (b"", b"") and "Invalid flow run id" in proc.output.read_text()


def test_a_run_with_other_prefect_settings_is_answered_cold(warm):
    _, path, env = warm
    conn, r, _ = _raw_request(path, {**env, "PREFECT_LOGGING_LEVEL": "DEBUG" if env.get(
        "PREFECT_LOGGING_LEVEL") != "DEBUG" else "INFO"})
    assert _lines(conn) == ["cold"]
    os.close(r)


def test_sigterm_to_the_client_reaches_its_forked_run_which_ends_as_a_cold_one_would(warm):
    proc, path, env = warm
    run_env = {**env, "PREFECT__FLOW_RUN_ID": str(uuid.uuid4())}
    cold = subprocess.Popen([sys.executable, "-m", "prefect.engine"], env=run_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    client = _client(path, run_env)
    children = lambda: _children(proc)  # noqa: E731
    _wait(lambda: children(), what="the forked run")
    (child,) = children()
    time.sleep(5)  # both inside the engine now, blocked on the frozen API
    cold.send_signal(signal.SIGTERM)
    client.send_signal(signal.SIGTERM)
    cold.communicate(timeout=60)
    client.communicate(timeout=60)
    _wait(lambda: _state(child) in ("gone", "Z"), what="the forked run to end")
    assert client.returncode == cold.returncode == -signal.SIGTERM


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_killed_client_takes_its_forked_run_with_it(warm):
    proc, path, env = warm
    client = _client(path, {**env, "PREFECT__FLOW_RUN_ID": str(uuid.uuid4())})
    children = lambda: _children(proc)  # noqa: E731
    _wait(lambda: children(), what="the forked run")
    (child,) = children()
    client.kill()
    client.wait(timeout=30)
    _wait(lambda: _state(child) in ("gone", "Z"), timeout=30, what="the forked run to die with its client")
    _wait(lambda: not children(), timeout=30, what="the warm process to reap it")


def test_the_warm_process_ends_when_its_worker_closes_stdin_after_its_last_run(warm):
    proc, path, env = warm
    client = _client(path, {**env, "PREFECT__FLOW_RUN_ID": str(uuid.uuid4())})
    _wait(lambda: _children(proc), what="the forked run")
    proc.stdin.close()
    _wait(lambda: not os.path.exists(path), what="the socket to go")
    time.sleep(1)
    assert proc.poll() is None  # its run goes on
    late = _client(path, {**env, "PREFECT__FLOW_RUN_ID": "not-a-run-id"})  # no warm process: starts cold
    assert late.communicate(timeout=120)[1].count(b"Invalid flow run id") == 1 and late.returncode == 1
    client.kill()
    client.wait(timeout=30)
    assert proc.wait(timeout=30) == 0


def test_a_forked_run_killed_with_sigkill_kills_its_client_the_same_way(warm):
    """The client must not try to reset SIGKILL's handler (it cannot) and
    end with a traceback and status 1."""
    proc, path, env = warm
    client = _client(path, {**env, "PREFECT__FLOW_RUN_ID": str(uuid.uuid4())})
    children = lambda: _children(proc)  # noqa: E731
    _wait(lambda: children(), what="the forked run")
    (child,) = children()
    os.kill(child, signal.SIGKILL)
    _, err = client.communicate(timeout=60)
    assert client.returncode == -signal.SIGKILL and b"warmstart_client" not in err


def test_bad_requests_end_only_themselves_and_their_fds_are_closed(warm):
    """A non-object body must not kill the warm process, and a rejected
    request's fds must not stay open (a reader of them never saw EOF)."""
    proc, path, env = warm
    for body, fds in ((b"[]", 3), (b"{not json", 3), (json.dumps({"env": env, "cwd": "/"}).encode(), 2)):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        r, w = os.pipe()
        socket.send_fds(conn, [struct.pack("!I", len(body))], [w] * fds)
        conn.sendall(body)
        os.close(w)
        assert _lines(conn) == []  # closed without an answer: the client starts the run cold
        assert os.read(r, 1) == b""  # every copy of the write end is closed
        os.close(r)
    assert proc.poll() is None
    conn, r, _ = _raw_request(path, {**env, "PREFECT__FLOW_RUN_ID": "not-a-run-id"})
    assert _lines(conn)[1:] == ["exit 1"]  # and it still serves runs
    os.close(r)


def test_a_client_whose_warm_process_dies_before_answering_starts_its_run_cold(warm):
    proc, path, env = warm
    os.kill(proc.pid, signal.SIGSTOP)
    client = _client(path, {**env, "PREFECT__FLOW_RUN_ID": "not-a-run-id"})
    time.sleep(1.5)  # connected, its request in the socket, no answer
    os.kill(proc.pid, signal.SIGKILL)
    _, err = client.communicate(timeout=120)
    # prefect.engine's own refusal of the id (with its traceback), run cold in the client's place; the client's own
    # ConnectionResetError is not shown
    assert client.returncode == 1 and "Invalid flow run id" in err.decode() and "warmstart_client" not in err.decode()


def test_a_client_whose_warm_process_is_stopped_starts_its_run_cold_and_the_late_fork_ends(warm):
    """A warm process stopped (SIGSTOP) must not hold every run in
    ``Submitting`` for as long as it stays stopped.  The client waits
    ``E31_WARM_ANSWER_S`` for its first answer, then runs cold; the warm
    process, resumed, forks the stale request, whose child finds the
    client gone and ends before the run starts."""
    proc, path, env = warm
    err = proc.output.with_name("client.err")
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        # its output to a file: the pipes' ends it sent (SCM_RIGHTS) wait in the stopped process's socket queue
        client = subprocess.Popen([sys.executable, "-S", str(CLIENT), path], stdout=subprocess.DEVNULL,
                                  stderr=open(err, "wb"),
                                  env={**env, "PREFECT__FLOW_RUN_ID": "not-a-run-id", "E31_WARM_ANSWER_S": "2"})
        client.wait(timeout=120)
        waited = time.monotonic() - started
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    # prefect.engine's own refusal of the id, run cold in the client's place after the 2 s
    assert client.returncode == 1 and "Invalid flow run id" in err.read_text(), err.read_text()[-2000:]
    assert waited >= 2
    _wait(lambda: b"BrokenPipeError" in proc.output.read_bytes(), timeout=60, what="the late fork to end")
    _wait(lambda: not _children(proc), timeout=30, what="the warm process to reap it")
    assert proc.poll() is None  # and it serves the next run
    conn, r, _ = _raw_request(path, {**env, "PREFECT__FLOW_RUN_ID": "not-a-run-id"})
    assert _lines(conn)[1:] == ["exit 1"]
    os.close(r)


def test_the_warm_process_reads_its_queue_deployment_once_for_all_its_forks(prefect_api, tmp_path):
    """``prefill``: the work pool, the queue deployment, its flow and its
    work queue, cached as Prefect's events look them up (each flow process
    read them: 4 requests), by a process that is still a single thread
    after it (else every run would start cold).  A pool without its queue
    deployment yet caches its work pool alone."""
    import ast

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from e31.deployments.worker import E31Worker
    from e31.flows.queue import ensure_pool
    from e31.specs.pool import parse_pool

    name = f"w{uuid.uuid4().hex[:8]}"
    pool = parse_pool({"pool_version": 1, "name": name, "nodes": [{"name": "n1", "cpus": 1, "memory": "1GiB"}]})
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment(ensure_pool(client, pool, E31Worker.get_default_base_job_template()))
    script = ("import importlib, sys; from e31.deployments import warmstart; "
              "[importlib.import_module(m) for m in warmstart.PRELOAD]; "
              "from prefect.events.related import RESOURCE_CACHE; "
              "from e31.deployments.warmprep import prefill; "
              "print(prefill(sys.argv[1]), warmstart.threads(), sorted(RESOURCE_CACHE))")
    done = subprocess.run([sys.executable, "-c", script, name], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(" ", 2)[:2] == ["4", "1"]
    assert ast.literal_eval(done.stdout.split(" ", 2)[2]) == sorted([
        f"work-pool.{name}", f"deployment.{deployment.id}", f"flow.{deployment.flow_id}",
        f"work-queue.{deployment.work_queue_id}"])
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=f"{name}-bare", type="e31"))
    bare = subprocess.run([sys.executable, "-c", script, f"{name}-bare"], capture_output=True, text=True, timeout=120)
    assert bare.stdout.startswith(f"1 1 ['work-pool.{name}-bare']"), bare.stdout + bare.stderr


def test_a_fork_starts_with_the_warm_process_s_objects_frozen_and_prefect_s_models_built(tmp_path):
    """Before it forks, the warm process builds the pydantic models Prefect
    builds at first use (the artifact a run returns, its flow-run updates)
    and freezes its objects (``gc.freeze``): a collection in the fork then
    walks none of them, so it copies none of their memory.  Measured on
    3 s jobs (bench_queue, 45 jobs): 0.72 CPU-s of user time per flow
    process before, 0.20 s after."""
    path = str(tmp_path / "warm.sock")
    script = (
        "import gc, json, os, sys\n"
        "from e31.deployments import warmstart\n"
        "import e31.flows.job, prefect.artifacts\n"
        "from prefect.artifacts import LinkArtifact\n"
        "from prefect.client.schemas.actions import FlowRunUpdate\n"
        "before = [LinkArtifact.__pydantic_complete__, FlowRunUpdate.__pydantic_complete__]\n"
        "from e31.deployments.warmprep import build_models\n"
        "built = build_models()\n"
        f"child = warmstart.Server({path!r}).serve()\n"
        "if child is not None:\n"
        "    print(json.dumps({'before': before, 'built': built, 'frozen': gc.get_freeze_count(),\n"
        "                      'after': [LinkArtifact.__pydantic_complete__, FlowRunUpdate.__pydantic_complete__]}),\n"
        "          flush=True)\n"
        "    os._exit(0)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        _wait(lambda: os.path.exists(path) or proc.poll() is not None, what="the warm process to listen")
        conn, r, _ = _raw_request(path, dict(os.environ))
        assert _lines(conn) == ["exit 0"]
        proc.stdin.close()
        seen = json.loads(proc.stdout.readline())
        assert proc.wait(timeout=30) == 0, seen
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert seen["before"] == [False, False] and seen["after"] == [True, True]
    assert seen["built"] > 100  # Prefect 3.9.1: 261 after PRELOAD and PRELOAD_OPTIONAL
    assert seen["frozen"] > 50_000  # the objects the collector tracks of Prefect and E31 imported (~130,000 here)
