"""A Prefect server of a benchmark's own (SQLite under the benchmark's
temporary folder, 127.0.0.1, a free port; no UI, no analytics), shared by
the benchmarks that need one; started through the benchmark's
:class:`tests.benchmarks.cleanup.Cleanup`, which stops it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.benchmarks.cleanup import spawn


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: Path) -> tuple[str, dict[str, str], subprocess.Popen]:
    """Start ``prefect server start`` with its home in ``root / "home"``;
    returns its API URL, the environment that points at it (also put in
    ``os.environ``) and its process (its own session), registered as a
    server with the :class:`~tests.benchmarks.cleanup.Cleanup` entered
    (stopped after the benchmark's other processes; ``RuntimeError`` when
    none is entered).  Does not wait for it to answer."""
    api = f"http://127.0.0.1:{free_port()}/api"
    env = {**os.environ, "PREFECT_HOME": str(root / "home"), "PREFECT_API_URL": api, "PREFECT_UI_ENABLED": "false",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "PREFECT_LOGGING_LEVEL": "WARNING",
           "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL"}
    os.environ.update(env)
    port = api.rsplit(":", 1)[1].split("/")[0]
    proc = spawn([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", port],
                 server=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return api, env, proc
