"""Process helpers shared by the supervisor and the CLI (no Prefect import)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator


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
    stderr instead of interrupting; the previous handlers come back after,
    except where the block set a handler of its own (e.g. one that holds the
    signals for good once the output is returned).  A no-op outside the main
    thread (where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    told = []

    def note(signum, frame) -> None:
        SIGNALLED.set()
        if not told:
            told.append(signum)
            print(message, file=sys.stderr)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is note:
                signal.signal(sig, handler)


#: Set when a SIGTERM or SIGINT was noted and not obeyed because the output was on its way
#: (:func:`signals_deferred`, :func:`defer_signals_after_work`; ``e31.flows.exitsignals.hold_signals``):
#: a Prefect worker sends one to the flow process of a run that was cancelled, so the flow then reads
#: its run's state before it ends (``e31.flows.attempt``).
SIGNALLED = threading.Event()

#: The handlers :func:`defer_signals_after_work` replaced (signal -> handler), and its own handler.
_AFTER_WORK: dict[int, object] = {}
_AFTER_WORK_NOTE: list[Callable[..., None]] = []


def defer_signals_after_work(message: str) -> None:
    """Once the work's child process has ended, its output is returned
    whatever comes: from now until :func:`end_signal_deferral`, SIGTERM and
    SIGINT print ``message`` (once) to stderr and set :data:`SIGNALLED`
    instead of interrupting.  Without it a signal between the work's end
    and the return (the newest checkpoint's upload, the run task's end, the
    return task's start) took the engine's default action and ended the
    flow process with the output undelivered: a Prefect worker SIGTERMs the
    flow process of every run it sees ``Cancelling``, also one whose work
    had finished.  Blocks set up later (the return's
    :func:`signals_deferred`, ``hold_signals``) put their own handlers on
    top.  Once per ended work (a retried run task sets it again); a no-op
    outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    told = []

    def note(signum, frame) -> None:
        SIGNALLED.set()
        if not told:
            told.append(signum)
            print(message, file=sys.stderr)

    for sig in (signal.SIGINT, signal.SIGTERM):
        current = signal.getsignal(sig)
        if not _AFTER_WORK_NOTE or current is not _AFTER_WORK_NOTE[0]:
            _AFTER_WORK.setdefault(sig, current)
        signal.signal(sig, note)
    _AFTER_WORK_NOTE[:] = [note]


def end_signal_deferral() -> None:
    """End :func:`defer_signals_after_work`: the handlers it replaced come
    back unless another has been set since (``hold_signals``, which holds
    them for good once the output is returned).  A no-op when none is
    deferred, or outside the main thread."""
    if threading.current_thread() is not threading.main_thread() or not _AFTER_WORK_NOTE:
        return
    note = _AFTER_WORK_NOTE[0]
    for sig, handler in _AFTER_WORK.items():
        if signal.getsignal(sig) is note:
            signal.signal(sig, handler)
    _AFTER_WORK.clear()
    _AFTER_WORK_NOTE.clear()


#: The environment variable that marks every process of one run of a work (inherited by all it starts).
TOKEN_VAR = "E31_WORK_TOKEN"


def set_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants
    (``prctl(PR_SET_CHILD_SUBREAPER)``): a grandchild of the work that
    double-forks or calls ``setsid()`` is re-parented here instead of to
    init, so it stays findable.  Returns whether it took effect."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # 36 = PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def processes_where(match: Callable[[list[bytes]], bool]) -> list[int]:
    """The pids of the live processes (not this one) whose environment, as
    its ``NAME=value`` entries in bytes, satisfies ``match``; those whose
    environment cannot be read are skipped.  Linux: reads ``/proc`` ([]
    without it)."""
    found = []
    me = os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if match(fh.read().split(b"\0")):
                    found.append(int(name))
        except OSError:
            continue
    return found


def sigkill_each(pids: list[int]) -> list[int]:
    """Send SIGKILL to each pid; returns those it was sent to (a process
    already gone, or not ours, is skipped)."""
    sent = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            sent.append(pid)
        except OSError:
            pass
    return sent


class WorkTree:
    """Every process of one run of a work, found by the environment marker
    ``E31_WORK_TOKEN=<token>`` its first process is started with (so found
    after ``setsid()`` or a double fork too, which a process group misses).
    Linux: reads ``/proc``; a process that cleared its environment escapes
    the marker, but not :func:`set_subreaper`."""

    def __init__(self, token: str):
        self.mark = f"{TOKEN_VAR}={token}".encode()
        self.peak_rss = 0  # bytes: the largest total resident memory seen by :meth:`rss`

    def pids(self) -> list[int]:
        """The pids of the live processes carrying the marker (not this process)."""
        return processes_where(lambda environ: self.mark in environ)

    def rss(self) -> int:
        """Total resident memory of the tree now, in bytes (``VmRSS`` of each
        process); updates :attr:`peak_rss`."""
        total = 0
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/status", "rb") as fh:
                    for line in fh:
                        if line.startswith(b"VmRSS:"):
                            total += int(line.split()[1]) * 1024
                            break
            except (OSError, ValueError, IndexError):
                continue
        self.peak_rss = max(self.peak_rss, total)
        return total

    def kill(self, spare: int | None = None) -> list[int]:
        """SIGKILL every process of the tree (a few passes, for processes
        started meanwhile) and reap those re-parented here, except ``spare``
        (the work's first process, which its ``Popen`` reaps); returns the
        pids killed."""
        killed: list[int] = []
        for _ in range(3):
            pids = self.pids()
            if not pids:
                break
            killed += sigkill_each(pids)
        for pid in set(killed) - {spare}:
            _reap(pid)
        return killed


def _reap(pid: int, wait_s: float = 1.0) -> None:
    """Collect ``pid`` if it is an exited child of this process (an orphan
    re-parented to this subreaper), so it does not linger as a zombie."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # not our child: its own parent reaps it
        if done or time.monotonic() > deadline:
            return
        time.sleep(0.01)
