"""Stopping a process the tests started in a session of its own (``start_new_session=True``)."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_group(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL after ``timeout`` seconds; nothing when it has
    already ended (its group gone with it)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()
