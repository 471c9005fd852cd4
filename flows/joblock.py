"""One run of a job at a time on a machine: an exclusive ``flock`` on
``<scratch>/<job>/job.lock``, held from before the work's child is started
until the attempt ends.  No Prefect import: ``e31 run`` takes the lock
before it loads Prefect."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from e31.errors import E31Error


class JobBusyError(E31Error, RuntimeError):
    """Another run of the same job holds its scratch folder on this machine.
    ``holder_pid``: that run's process (None when unknown); ``holder_run``:
    its Prefect flow run id (None when it has none, e.g. ``e31 run``)."""

    def __init__(self, message: str, holder_pid: int | None = None, holder_run: str | None = None):
        super().__init__(message)
        self.holder_pid, self.holder_run = holder_pid, holder_run


#: The environment variable naming a flow process's flow run (Prefect's); recorded in the lock beside the pid.
RUN_ENV = "PREFECT__FLOW_RUN_ID"


def lock_holder(scratch: str) -> tuple[int | None, str | None]:
    """(pid, flow run id) recorded in ``<scratch>/job.lock`` by the run that
    holds it, or last held it ((None, None) when unreadable).  Whether it is
    held still is for the caller to check (the pid alive)."""
    try:
        words = (Path(scratch) / "job.lock").read_text(errors="replace").split()
    except OSError:
        return None, None
    pid = int(words[0]) if words and words[0].isdigit() else None
    return pid, (words[1] if len(words) > 1 else None)


_LOCKS: dict[str, int] = {}  # scratch folder -> open file descriptor holding its lock
_HANDED: set[str] = set()  # scratch folders locked by hold_for_run for the next lock_job here


def hold_for_run(scratch: str, job: str) -> None:
    """Take the job's lock now for the run this process starts next (its
    ``lock_job`` takes it over): ``e31 run`` holds it from before it starts
    the work's child to the flow's end.  Raises :class:`JobBusyError`."""
    Path(scratch).mkdir(parents=True, exist_ok=True)
    lock_job(scratch, job)
    _HANDED.add(scratch)


def lock_job(scratch: str, job: str) -> None:
    """Hold an exclusive ``flock`` on ``<scratch>/job.lock`` until
    :func:`end_attempt` / :func:`unlock_job` (or this process's death: the
    kernel drops it).  Raises :class:`JobBusyError` when another run holds
    it, in this process too -- except the one lock :func:`hold_for_run` took
    for the next run here, which this call takes over."""
    if scratch in _HANDED:
        _HANDED.discard(scratch)
        return
    fd = os.open(Path(scratch) / "job.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid, run = lock_holder(scratch)
        raise JobBusyError(
            f"job {job} is already running on this machine (pid {pid or '?'}, scratch {scratch}); "
            "wait for it to end, or run this one under another name (--set name=...)", pid, run
        ) from None
    os.ftruncate(fd, 0)  # "PID [FLOW_RUN_ID]": who holds it (lock_holder)
    os.pwrite(fd, " ".join(filter(None, (str(os.getpid()), os.environ.get(RUN_ENV)))).encode(), 0)
    _LOCKS[scratch] = fd


def lock_busy(scratch: str) -> bool:
    """Whether another open file holds ``<scratch>/job.lock`` now (a run of
    the job, or a worker or ``e31 return`` delivering its output): a probe
    that takes the lock and gives it back at once.  False when there is no
    lock file or it cannot be opened."""
    try:
        fd = os.open(Path(scratch) / "job.lock", os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing the file drops a lock this probe took
    return False


def unlock_job(scratch: str) -> None:
    """Release the lock :func:`lock_job` took (no-op when not held)."""
    _HANDED.discard(scratch)
    fd = _LOCKS.pop(scratch, None)
    if fd is not None:
        os.close(fd)
