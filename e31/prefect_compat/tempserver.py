"""A temporary Prefect server for one ``e31 run`` when no API is configured.

Prefect would start its own temporary server in the CLI's process group, so
a Ctrl-C at the terminal (SIGINT to the whole group) would kill the API in
the middle of the run, before the stop and the return that the Ctrl-C asks
for.  E31 starts ``prefect server start`` itself instead: in its own session
(the terminal's signals do not reach it), bound to 127.0.0.1 on a free port,
killed by the kernel if ``e31`` dies (``PR_SET_PDEATHSIG``), and stopped when
the run ends.  It uses the usual ``PREFECT_HOME`` database, so runs show in a
UI started later from the same home.

Two servers that create (or migrate) that database at once break it: the
second one's migration fails (``duplicate column name``) and its run exits
3.  The first start of a server on a home is therefore serialised by an
exclusive ``flock`` on ``$PREFECT_HOME/.e31-db.lock``, held until the server
answers (its migrations done); a marker ``.e31-db-ready`` naming the Prefect
version then lets later starts of that version run side by side.

Measured on Prefect 3.9.1: its temporary server
(``prefect.server.api.server.SubprocessASGIServer``, started when no
``PREFECT_API_URL`` is set and ephemeral mode is allowed) is a plain
``subprocess.Popen`` of uvicorn, in the caller's session and process
group.  Upstream offers no setting to start it apart; a configured
``PREFECT_API_URL`` (a server started by hand) needs none of this.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from e31.prefect_compat.api import api_ready
from e31.tasks.supervisor.process import die_with_parent

STARTUP_TIMEOUT_S = 120.0  # a fresh PREFECT_HOME migrates its database first (~25 s on 2 cores)
LOCK_NAME = ".e31-db.lock"  # in PREFECT_HOME: held while a server creates or migrates the database
READY_NAME = ".e31-db-ready"  # in PREFECT_HOME: the Prefect version whose server has set the database up


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prefect_api() -> Iterator[str | None]:
    """Yield the Prefect API URL to use: the configured ``PREFECT_API_URL``
    (environment or profile; then nothing is started), else a temporary
    server's, set as Prefect's API URL for this process (and exported to its
    children) until the block ends; while another server sets up the same
    ``PREFECT_HOME``'s database, waits for it first (:func:`_first_start`).
    Raises ``RuntimeError`` when the server does not come up within
    :data:`STARTUP_TIMEOUT_S` seconds, or the other one holds the database
    lock longer than that."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        yield PREFECT_API_URL.value()
        return
    with _first_start():
        port = _free_port()
        url = f"http://127.0.0.1:{port}/api"
        proc, log = _start(port, url)
    try:
        os.environ["PREFECT_API_URL"] = url
        with temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                _send_logs()
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        _stop(proc)
        log.close()


def _start(port: int, url: str):
    """Start ``prefect server start`` on ``port`` and wait until ``url``
    answers; returns ``(process, log file)``.  Raises ``RuntimeError`` (the
    server stopped) when it exits or does not answer in time."""
    env = {**os.environ, "PREFECT_UI_ENABLED": os.environ.get("PREFECT_UI_ENABLED", "false"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_LOGGING_LEVEL": "WARNING"}
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=die_with_parent,
    )
    try:
        _wait_ready(proc, url, log)
    except BaseException:
        _stop(proc)
        log.close()
        raise
    return proc, log


@contextlib.contextmanager
def _first_start() -> Iterator[None]:
    """Hold ``$PREFECT_HOME/.e31-db.lock`` (an exclusive ``flock``, released
    by the kernel if this process dies) around a server start while that
    home's database may still be created or migrated: unless
    ``.e31-db-ready`` names the installed Prefect version, which is written
    (with a hash of the database URL) once a server under the lock has
    answered.  Waits for the lock up to
    :data:`STARTUP_TIMEOUT_S` seconds (the holder's own start is bounded by
    the same), then raises ``RuntimeError`` naming the lock file."""
    import hashlib

    import prefect
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    home = Path(settings.home).expanduser()
    database = settings.server.database.connection_url
    database = database.get_secret_value() if database is not None else ""
    # the version and the database (hashed: its URL may hold a password) a server has set up
    setup = f"{prefect.__version__} {hashlib.sha256(database.encode()).hexdigest()[:16]}"
    ready = home / READY_NAME
    if _read(ready) == setup:
        yield
        return
    home.mkdir(parents=True, exist_ok=True)
    lock = home / LOCK_NAME
    with open(lock, "a") as handle:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        told = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another Prefect server has been setting up the database in {home} for over "
                                       f"{STARTUP_TIMEOUT_S:g} s (it holds {lock}); try again when it has started, "
                                       "or set PREFECT_API_URL to a running server") from None
                if not told:
                    print(f"e31: waiting for another temporary Prefect server to set up the database in {home}",
                          file=sys.stderr)
                    told = True
                time.sleep(0.2)
        try:
            yield
            ready.write_text(setup)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _wait_ready(proc: subprocess.Popen, url: str, log) -> None:
    print(f"e31: starting a temporary Prefect server on {url} (set PREFECT_API_URL to use your own)", file=sys.stderr)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            err = log.read().decode(errors="replace").strip().splitlines()
            raise RuntimeError(f"the temporary Prefect server exited with code {proc.returncode}: {err[-1] if err else ''}")
        if api_ready(url):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the temporary Prefect server did not answer within {STARTUP_TIMEOUT_S:g} s")


def _send_logs() -> None:
    """Send the run logs still queued for the API before its server goes."""
    from prefect.logging.handlers import APILogWorker

    with contextlib.suppress(Exception):
        APILogWorker.drain_all(timeout=5)


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
