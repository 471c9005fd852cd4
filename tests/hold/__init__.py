"""Holding a flow process still at a chosen write (see ``sitecustomize``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

#: The folder to put first on ``PYTHONPATH`` of the processes that carry the hold.
FOLDER = Path(__file__).parent


def env(status: str, mark: Path) -> dict[str, str]:
    """Environment entries that make the first process to write a
    ``manifest.json`` of ``status`` stop itself; ``mark`` (a file path, not
    yet there) records that the hold is spent."""
    return {"E31_TEST_HOLD": status, "E31_TEST_HOLD_MARK": str(mark),
            "PYTHONPATH": os.pathsep.join(p for p in (str(FOLDER), os.environ.get("PYTHONPATH")) if p)}


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (state ``T`` in ``/proc/<pid>/stat``)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"T"
    except (OSError, IndexError):
        return False


def wait_stopped(pid_of, timeout: float = 180.0) -> int:
    """Wait until ``pid_of()`` (None until known) names a stopped process; returns its pid.

    Raises AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        pid = pid_of()
        if pid is not None and stopped(pid):
            return pid
        assert time.monotonic() < deadline, f"no process held in {timeout:g} s (last pid {pid})"
        time.sleep(0.05)
