"""Test session set-up: quiet Prefect settings, one real Prefect server.

The Prefect settings must be in the environment before anything imports
prefect, so they are set when this file is imported.  The server itself
(``prefect server start``, SQLite, 127.0.0.1) starts only when a test asks for
the ``prefect_api`` fixture, once per session (~10-25 s), and is stopped at
the end.  Subprocesses (``e31 run``) inherit ``PREFECT_API_URL``.

Each pytest-xdist worker (``pytest -n 4``) imports this file in its own
process, so each has its own session folder, port, ``PREFECT_HOME``, Prefect
server, S3 server, default scratch root and transfer-markers folder: tests on
different workers share no Prefect objects (work pools, Variables,
deployments) and no files.

A test that needs a server (it asks for ``prefect_api`` or ``s3_server``,
directly or through another fixture, or it is marked ``server`` because it
starts one of its own) is marked ``server`` at collection; ``pytest -m "not
server and not slow"`` is the quick subset (docs/testing.md).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.procs import stop_group  # noqa: F401  (tests import it from here)

from e31.prefect_compat.api import api_ready

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "specs" / "examples" / "digits-nightly-retrain.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SESSION_DIR = Path(tempfile.mkdtemp(prefix="e31-tests-"))
_PORT = _free_port()
_QUIET = {
    "PREFECT_HOME": str(_SESSION_DIR / "prefect-home"),
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_API_URL": f"http://127.0.0.1:{_PORT}/api",
    "PREFECT_SERVER_UI_API_URL": f"http://127.0.0.1:{_PORT}/api",
    # A job run without its own E31_SCRATCH must not share ~/.cache/e31/scratch/<job>/ with a job of the same
    # name on another test worker, and a prefetch must not pause for transfers of other workers' or other users'
    # runs on this machine (the markers folder is machine-wide by default).
    "E31_SCRATCH": str(_SESSION_DIR / "scratch"),
    "E31_TRANSFERS_DIR": str(_SESSION_DIR / "transfers"),
}
os.environ.update(_QUIET)

_SESSION_PASSED: list[bool] = []


def pytest_sessionfinish(session, exitstatus):
    """Note whether this process's tests passed: its session folder (servers'
    data, scratch: up to hundreds of MiB) is removed at its exit when they did
    (:func:`_remove_session_dir`); kept, and named, when one failed, for the
    server logs it holds."""
    _SESSION_PASSED.append(exitstatus == 0)
    if exitstatus != 0:
        print(f"\ntest session folder kept: {_SESSION_DIR}", file=sys.stderr)


def _remove_session_dir() -> None:
    """At the process's exit, after Prefect's own exit handlers (registered later, so run earlier), which
    may still write under its ``PREFECT_HOME`` there."""
    import shutil

    if _SESSION_PASSED and all(_SESSION_PASSED) and not os.environ.get("E31_KEEP_TEST_DIRS"):
        shutil.rmtree(_SESSION_DIR, ignore_errors=True)


import atexit  # noqa: E402

atexit.register(_remove_session_dir)


#: Fixtures that start a real server: a test that uses one (directly or through another fixture) is marked ``server``.
SERVER_FIXTURES = frozenset({"prefect_api", "s3_server"})


def pytest_collection_modifyitems(config, items):
    """Mark every test that needs a server ``server``, and run the longest
    tests (marked ``slow`` or ``server``-by-hand: they start servers of their
    own) first, so that a parallel run does not end waiting on one of them."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
    own = {id(item) for item in items if item.get_closest_marker("slow") or (
        item.get_closest_marker("server") and not SERVER_FIXTURES & set(getattr(item, "fixturenames", ())))}
    items.sort(key=lambda item: id(item) not in own)  # stable: the collection order otherwise


SERVER: list[subprocess.Popen] = []  # the session's prefect server process, while it runs (to freeze it)


#: The session server's database: ``sqlite`` (Prefect's default) or ``postgresql`` (a private cluster of
#: Debian's PostgreSQL per test process, :mod:`tests.pgserver`), from ``E31_TEST_DATABASE``.
DATABASE = os.environ.get("E31_TEST_DATABASE", "sqlite")


@pytest.fixture(scope="session")
def prefect_api():
    """A real ``prefect server start`` on 127.0.0.1 for the whole session,
    on :data:`DATABASE`; yields its API URL."""
    from contextlib import ExitStack

    stack = ExitStack()
    env = {**os.environ, "PREFECT_UI_ENABLED": "true"}  # the UI test opens its pages
    if DATABASE == "postgresql":
        from tests.pgserver import postgres, unavailable

        why = unavailable()
        if why:
            raise RuntimeError(f"E31_TEST_DATABASE=postgresql: {why}")
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = stack.enter_context(postgres()).url
    elif DATABASE != "sqlite":
        raise RuntimeError(f"E31_TEST_DATABASE={DATABASE!r}: give sqlite or postgresql")
    log = open(_SESSION_DIR / "prefect-server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(_PORT)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    SERVER[:] = [proc]
    url = os.environ["PREFECT_API_URL"]
    deadline = time.monotonic() + (300 if DATABASE == "postgresql" else 120)  # a new database's migrations
    while not api_ready(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            stack.close()
            raise RuntimeError(f"prefect server did not start; see {_SESSION_DIR / 'prefect-server.log'}")
        time.sleep(0.5)
    yield url
    import logging

    for name in ("prefect.flow_runs", "prefect.task_runs"):  # send buffered run logs before the server goes
        for handler in logging.getLogger(name).handlers:
            handler.flush()
    stop_group(proc)
    log.close()
    stack.close()


def prefect_ui_url() -> str:
    """The session server's UI address (``http://127.0.0.1:PORT``)."""
    return f"http://127.0.0.1:{_PORT}"


def final_manifest(folder: Path) -> dict | None:
    """The manifest in ``folder`` once it is final (not the ``returning`` one a
    return writes first), else None: what a test waits on for "returned"."""
    import json

    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return manifest if manifest.get("status") != "returning" else None


def place_by_hand(client, run_id, node: str, devices=(), cpus: int = 1) -> None:
    """Record a placement on the flow run ``run_id`` as the E31 scheduler
    writes it (its ``placement`` parameter, the other parameters kept), for
    a test that plays the scheduler's part; the state is the caller's."""
    parameters = dict(client.read_flow_run(run_id).parameters or {})
    parameters["placement"] = {"e31_node": node, "gpu_devices": list(devices), "cpus": cpus, "e31_attempt": 0}
    client.update_flow_run(run_id, parameters=parameters)


S3_KEY = "e31testkey"
S3_SECRET = "e31-PLANTED-secret-7Hq2"  # tests grep outputs for it: it must never leak
S3_BUCKET = "e31-test"


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 server (SeaweedFS ``weed mini``, 127.0.0.1, free ports) for
    the whole session, with bucket ``e31-test`` and enforced credentials
    (``S3_KEY`` / ``S3_SECRET``); starts in about 1.5 s.  Yields the
    :class:`tests.s3server.S3Server` (``endpoint``, ``key``, ``secret``,
    ``bucket``, ``env()``, ``filesystem()``).  Sets ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL`` and ``AWS_DEFAULT_REGION``
    in ``os.environ`` until the end of the session, so s3fs, botocore and
    subprocesses started later (``e31 run``, workers) reach it with no
    arguments.  The log is ``<session dir>/seaweed/seaweed.log``."""
    from tests.s3server import seaweed

    with seaweed(_SESSION_DIR / "seaweed", key=S3_KEY, secret=S3_SECRET, bucket=S3_BUCKET) as server:
        saved = {name: os.environ.get(name) for name in server.env()}
        os.environ.update(server.env())
        try:
            yield server
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@pytest.fixture
def s3_prefix(s3_server) -> str:
    """A fresh, unused ``s3://e31-test/<uuid>/`` prefix for this test (with
    the trailing slash; nothing is cleaned up: deleted prefixes linger in
    SeaweedFS listings for minutes)."""
    import uuid

    return f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/"


@pytest.fixture
def process_worker(prefect_api, tmp_path):
    """A new Prefect work pool of type process and one real worker polling it
    every second from the repository root (``tests/flows`` importable, its own
    ``E31_SCRATCH``); yields the pool's name.  The log is ``tmp_path/worker.log``."""
    import uuid

    pool = f"e31-{uuid.uuid4().hex[:6]}"
    subprocess.run([sys.executable, "-m", "prefect", "work-pool", "create", pool, "--type", "process"],
                   check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "flows"), str(REPO)]),
           "PREFECT_WORKER_QUERY_SECONDS": "1", "E31_SCRATCH": str(tmp_path / "worker-scratch")}
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool], env=env, cwd=REPO,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        yield pool
        stop_group(worker, timeout=20)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A fresh ``E31_SCRATCH`` for the test (jobs resume from scratch state)."""
    root = tmp_path / "scratch"
    monkeypatch.setenv("E31_SCRATCH", str(root))
    return root


@pytest.fixture
def e31():
    """Run the installed ``e31`` console script: ``e31("validate", path)``
    returns the ``CompletedProcess`` (text stdout/stderr, cwd = repository)."""

    def run(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        exe = Path(sys.executable).with_name("e31")
        return subprocess.run(
            [str(exe), *args], capture_output=True, text=True, timeout=timeout,
            env={**os.environ, **(env or {})}, cwd=REPO,
        )

    return run
