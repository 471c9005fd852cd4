"""How a process that ran a job ends once the job's output is returned:
a late SIGTERM or SIGINT is noted and ignored, so it no longer changes the
exit status (the ``e31`` command, and a flow process a Prefect worker
started)."""

from __future__ import annotations

import signal
import sys
from typing import Callable

from e31.tasks.supervisor.process import SIGNALLED


#: Set by the ``e31`` command (and true in a flow process started by a Prefect worker): once the
#: output is delivered, SIGTERM and SIGINT no longer change how the process ends.
HOLD_SIGNALS_AFTER_RETURN = False


def hold_signals() -> None:
    """After the output is delivered the job is over: a late SIGTERM/SIGINT
    (a worker's, a terminal's) is noted and ignored instead of ending the
    process with 143 or 130 -- in the ``e31`` command and in a flow process
    a Prefect worker started (``python -m prefect.engine``), never in a
    caller's own Python program."""
    import threading

    by_worker = sys.argv and sys.argv[0].replace("\\", "/").endswith("prefect/engine.py")
    if not (HOLD_SIGNALS_AFTER_RETURN or by_worker) or threading.current_thread() is not threading.main_thread():
        return
    told = []

    def note(signum, frame) -> None:
        SIGNALLED.set()  # (a worker's SIGTERM after a cancel: the run reads its state before it ends)
        if not told:
            told.append(signum)
            print("e31: the output is returned; the signal is ignored and the run ends with its manifest",
                  file=sys.stderr)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, note)
    ignore_signals_at_exit()


_IGNORING_AT_EXIT: list[bool] = []


def ignore_signals_at_exit(when: Callable[[], bool] | None = None) -> None:
    """Ignore SIGTERM and SIGINT (``SIG_IGN``) from the interpreter's exit
    on: always (``when`` None; registered once per process), or when
    ``when()`` is true at exit (the ``e31`` command: once its job's output
    was delivered).  At exit CPython puts ``SIG_DFL`` back for every signal
    with a Python handler (``_PySignal_Fini``), so a late signal there would
    still end the process with 143 after the output was returned; an
    ignored signal is left ignored.  Registered with :mod:`atexit`, whose
    functions run before that reset."""
    import atexit

    if when is None:
        if _IGNORING_AT_EXIT:
            return
        _IGNORING_AT_EXIT.append(True)

    def ignore() -> None:
        if when is not None and not when():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, signal.SIG_IGN)
            except ValueError:  # not the main thread
                pass

    atexit.register(ignore)
