"""Transfer markers: which processes are staging or returning a job on this
machine.  A process marks itself with an empty file ``<job>.<pid>`` in the
machine's markers folder (:func:`transfers_dir`) for the length of its
transfers; a node's prefetcher pauses while any live process has one
(:func:`transfers_busy`), since runs on one machine share its network and
disks whatever their node or scratch root."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def transfers_dir() -> Path:
    """The machine's folder of transfer markers: ``$E31_TRANSFERS_DIR``, else
    ``<temp dir>/e31-transfers-<uid>`` (one per machine and user, whatever
    the scratch root)."""
    import tempfile

    return Path(os.environ.get("E31_TRANSFERS_DIR") or Path(tempfile.gettempdir()) / f"e31-transfers-{os.getuid()}")


#: Set in a flow process forked by a worker's warm process (:mod:`e31.deployments.warmstart`): the pid of
#: the process Prefect's worker started for the run (the warm start's client), which names its markers.
FLOW_PROCESS_PID_VAR = "E31_FLOW_PROCESS_PID"


def flow_process_pid() -> int:
    """The pid the worker knows for this flow process (``$E31_FLOW_PROCESS_PID``
    when forked warm, else this process's): the pid :func:`mark_starting`
    marked, so :func:`transferring` takes that marker over.  That process
    lives as long as this one."""
    text = os.environ.get(FLOW_PROCESS_PID_VAR, "")
    return int(text) if text.isdigit() else os.getpid()


@contextmanager
def transferring(job: str, folder: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Mark this process as staging or returning ``job`` on this machine
    for the block (``folder``: the markers' folder, default :func:`transfers_dir`)."""
    folder = Path(folder) if folder is not None else transfers_dir()
    marker = folder / f"{job}.{flow_process_pid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:  # a full disk: the marker is a courtesy to the prefetcher, never a reason to fail
        marker = None
    try:
        yield
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)


def mark_starting(job: str, pid: int, folder: str | os.PathLike[str] | None = None) -> None:
    """Mark the flow process ``pid`` (just started by a worker) as staging
    ``job`` already: the marker :func:`transferring` will take over in that
    process and remove when its staging ends, so prefetches on this machine
    also pause while the process starts (its imports and engine set-up
    compete with a prefetch for the CPU).  Best effort; a marker of a
    process that dies first is removed by :func:`transfers_busy`."""
    folder = Path(folder) if folder is not None else transfers_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{job}.{pid}").touch()
    except OSError:
        pass


def transfers_busy(folder: str | os.PathLike[str] | None = None) -> bool:
    """Whether a live process is staging or returning a job on this
    machine (markers of dead processes are removed; ``folder`` as for
    :func:`transferring`)."""
    folder = Path(folder) if folder is not None else transfers_dir()
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    busy = False
    for name in names:
        pid = name.rpartition(".")[2]
        if not pid.isdigit():
            continue  # not a marker
        if alive(int(pid)):
            busy = True
        else:
            (folder / name).unlink(missing_ok=True)
    return busy


def alive(pid: int) -> bool:
    """Whether the process ``pid`` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
