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
    """Another run of the same job holds its scratch folder on this machine."""


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
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise JobBusyError(
            f"job {job} is already running on this machine (pid {holder}, scratch {scratch}); "
            "wait for it to end, or run this one under another name (--set name=...)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _LOCKS[scratch] = fd


def unlock_job(scratch: str) -> None:
    """Release the lock :func:`lock_job` took (no-op when not held)."""
    _HANDED.discard(scratch)
    fd = _LOCKS.pop(scratch, None)
    if fd is not None:
        os.close(fd)
