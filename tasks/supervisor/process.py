"""Process helpers shared by the supervisor and the CLI (no Prefect import)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


def die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGKILL it when the supervisor
    dies (``prctl(PR_SET_PDEATHSIG)``), so a killed flow leaves no orphan
    training on.  The signal follows the creating thread, hence main thread
    only.  A no-op where prctl is missing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def signals_deferred(message: str) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM print ``message`` (once) to
    stderr instead of interrupting; the previous handlers come back after.
    A no-op outside the main thread (where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    told = []

    def note(signum, frame) -> None:
        if not told:
            told.append(signum)
            print(message, file=sys.stderr)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
