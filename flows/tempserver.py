"""A temporary Prefect server for one ``e31 run`` when no API is configured.

Prefect would start its own temporary server in the CLI's process group, so
a Ctrl-C at the terminal (SIGINT to the whole group) would kill the API in
the middle of the run, before the stop and the return that the Ctrl-C asks
for.  E31 starts ``prefect server start`` itself instead: in its own session
(the terminal's signals do not reach it), bound to 127.0.0.1 on a free port,
killed by the kernel if ``e31`` dies (``PR_SET_PDEATHSIG``), and stopped when
the run ends.  It uses the usual ``PREFECT_HOME`` database, so runs show in a
UI started later from the same home.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from e31.tasks.supervisor.api import api_ready
from e31.tasks.supervisor.process import die_with_parent

STARTUP_TIMEOUT_S = 120.0  # a fresh PREFECT_HOME migrates its database first (~25 s on 2 cores)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prefect_api() -> Iterator[str | None]:
    """Yield the Prefect API URL to use: the configured ``PREFECT_API_URL``
    (environment or profile; then nothing is started), else a temporary
    server's, set as Prefect's API URL for this process (and exported to its
    children) until the block ends.  Raises ``RuntimeError`` when the server
    does not come up within :data:`STARTUP_TIMEOUT_S` seconds."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        yield PREFECT_API_URL.value()
        return
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_UI_ENABLED": os.environ.get("PREFECT_UI_ENABLED", "false"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_LOGGING_LEVEL": "WARNING"}
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=die_with_parent,
    )
    try:
        _wait_ready(proc, url, log)
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
