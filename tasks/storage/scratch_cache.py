"""The staged copies a node's scratch keeps, and who may write them.

A job's inputs are staged under ``<scratch root>/<job>/data/<name>`` with a
record ``<name>.stage.json`` beside each (:mod:`e31.tasks.stage`).  Two
kinds of writer share that folder: the job's own flow run, and the node's
prefetcher (``e31 worker``), which stages a queued job's inputs before the
job is allocated.  This module keeps them apart and keeps the copies within
a budget:

- :func:`take_data` -- the flow run's exclusive ``flock`` on
  ``<scratch>/<job>/data.lock``, from before staging to the attempt's end
  (the work reads the copies: nobody may replace them meanwhile).  A
  prefetch holding it is asked to yield (``data.wanted``) and stops within a
  chunk: a prefetch never holds back its own job.
- :func:`try_hold_data` -- the prefetcher's: never waits.
- :func:`transferring` / :func:`transfers_busy` -- a marker per flow run that
  is staging or returning on this machine (:func:`transfers_dir`); the
  prefetcher pauses while one exists, so it never slows a job that holds
  its resources (nodes sharing a machine share its network and disks).
- :func:`staged_copies` / :func:`evict` -- the copies in a scratch root, and
  the eviction of the least recently used ones (never a job's whose
  ``data.lock`` is held) down to a byte budget.

No Prefect import.  Linux/POSIX ``flock``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

LOCK, WANTED = "data.lock", "data.wanted"


@dataclass(frozen=True)
class StagedCopy:
    """One staged input: its ``job`` and input ``name``, the copy's ``path``,
    its ``bytes`` and when it was last staged or reused (``used``, Unix
    seconds: the record's mtime)."""

    job: str
    name: str
    path: Path
    bytes: int
    used: float

    @property
    def record(self) -> Path:
        return self.path.with_name(f"{self.name}.stage.json")


def _lock_fd(scratch: Path) -> int:
    scratch.mkdir(parents=True, exist_ok=True)
    return os.open(scratch / LOCK, os.O_RDWR | os.O_CREAT, 0o644)


_HELD: dict[str, int] = {}  # job scratch folder -> the descriptor holding its data.lock for a flow run


def take_data(scratch: str | os.PathLike[str]) -> None:
    """Hold the job's data folder (``scratch`` is ``<root>/<job>``) for a
    flow run, until :func:`release_data` (or this process's death): waits
    for a prefetch that holds it to yield -- it is asked to (``data.wanted``)
    and stops within a chunk of its transfer.  Never raises for a busy lock."""
    scratch = Path(scratch)
    fd = _lock_fd(scratch)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        wanted = scratch / WANTED
        wanted.touch()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        finally:
            wanted.unlink(missing_ok=True)
    old = _HELD.pop(str(scratch), None)
    if old is not None:
        os.close(old)
    _HELD[str(scratch)] = fd


def release_data(scratch: str | os.PathLike[str]) -> None:
    """Release what :func:`take_data` took (no-op when not held)."""
    fd = _HELD.pop(str(Path(scratch)), None)
    if fd is not None:
        os.close(fd)


@contextmanager
def try_hold_data(scratch: str | os.PathLike[str]) -> Iterator[bool]:
    """Hold the job's data folder for a prefetch if nobody does (yields
    True), else yields False at once."""
    fd = _lock_fd(Path(scratch))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def yield_wanted(scratch: str | os.PathLike[str]) -> bool:
    """Whether a flow run of the job waits for the data folder (a prefetch holding it must stop)."""
    return (Path(scratch) / WANTED).exists()


def data_in_use(scratch: str | os.PathLike[str]) -> bool:
    """Whether a flow run or a prefetch holds the job's data folder now (a
    probe that takes and drops the lock at once; the folder is not made)."""
    path = Path(scratch) / LOCK
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def transfers_dir() -> Path:
    """The machine's folder of transfer markers: ``$E31_TRANSFERS_DIR``, else
    ``<temp dir>/e31-transfers-<uid>`` (one per machine and user, whatever
    the scratch root)."""
    import tempfile

    return Path(os.environ.get("E31_TRANSFERS_DIR") or Path(tempfile.gettempdir()) / f"e31-transfers-{os.getuid()}")


@contextmanager
def transferring(job: str, folder: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Mark this process as staging or returning ``job`` on this machine
    for the block (``folder``: the markers' folder, default :func:`transfers_dir`)."""
    folder = Path(folder) if folder is not None else transfers_dir()
    marker = folder / f"{job}.{os.getpid()}"
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
        if _alive(int(pid)):
            busy = True
        else:
            (folder / name).unlink(missing_ok=True)
    return busy


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def staged_copies(root: str | os.PathLike[str]) -> list[StagedCopy]:
    """Every staged input under the scratch root ``root``, least recently
    used first.  Sizes come from the records (``bytes``), else from a walk
    of the copy."""
    found = []
    root = Path(root)
    try:
        jobs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []
    for job in jobs:
        data = job / "data"
        try:
            records = [p for p in data.iterdir() if p.name.endswith(".stage.json") and not p.name.startswith(".")]
        except OSError:
            continue
        for record in records:
            name = record.name[:-len(".stage.json")]
            try:
                used = record.stat().st_mtime
                size = json.loads(record.read_text()).get("bytes")
            except (OSError, ValueError):
                continue
            path = data / name
            if not isinstance(size, int):
                size = _size(path)
            found.append(StagedCopy(job.name, name, path, size, used))
    return sorted(found, key=lambda c: c.used)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def evict(root: str | os.PathLike[str], need: int, budget: int,
          keep: set[str] | frozenset[str] = frozenset()) -> tuple[bool, list[StagedCopy]]:
    """Make room for ``need`` more bytes of staged copies under ``root``
    within ``budget`` bytes: remove the least recently used copies first,
    never those of the jobs named in ``keep`` or of a job whose data folder is in use
    (:func:`data_in_use`: a run or a prefetch holds it).  Each copy goes
    record first, then its folder, so a kill in between leaves a folder no
    run reuses (a copy without its record is staged again).  Returns
    ``(fits, evicted)``; when it cannot fit, nothing is removed."""
    copies = staged_copies(root)
    total = sum(c.bytes for c in copies)
    if total + need <= budget:
        return True, []
    chosen, freed = [], 0
    for copy in copies:
        if copy.job in keep or data_in_use(Path(root) / copy.job):
            continue
        chosen.append(copy)
        freed += copy.bytes
        if total - freed + need <= budget:
            break
    if total - freed + need > budget:
        return False, []
    for copy in chosen:
        copy.record.unlink(missing_ok=True)
        if copy.path.is_dir():
            shutil.rmtree(copy.path, ignore_errors=True)
        else:
            copy.path.unlink(missing_ok=True)
    return True, chosen


def touch_record(record: Path) -> None:
    """Note that a staged copy was used now (its record's mtime: the order of eviction)."""
    try:
        os.utime(record, (time.time(), time.time()))
    except OSError:
        pass


def remove_torn(data_dir: Path) -> list[str]:
    """Remove the ``.<name>.part-<id>`` folders an interrupted staging left
    (call only while holding the data folder); returns their names."""
    gone = []
    try:
        names = os.listdir(data_dir)
    except OSError:
        return []
    for name in names:
        if name.startswith(".") and ".part-" in name:
            shutil.rmtree(data_dir / name, ignore_errors=True)
            gone.append(name)
    return gone


#: The prefetcher's note in a job's data folder: which flow run's inputs it staged, where, in how long.
PREFETCH_NOTE = ".prefetch.json"


def note_prefetch(data_dir: Path, run_id: str, node: str, seconds: float, nbytes: int) -> None:
    """Record that the inputs of flow run ``run_id`` were staged here by
    the prefetcher of ``node`` in ``seconds`` (``nbytes`` copied)."""
    try:
        (Path(data_dir) / PREFETCH_NOTE).write_text(json.dumps(
            {"run_id": run_id, "node": node, "seconds": round(seconds, 3), "bytes": nbytes, "at": time.time()}))
    except OSError:
        pass


def prefetched_seconds(data_dir: Path, run_id: str | None) -> float:
    """Seconds the prefetcher spent staging flow run ``run_id``'s inputs
    into ``data_dir`` before its allocation (0.0: no prefetch for that run)."""
    try:
        note = json.loads((Path(data_dir) / PREFETCH_NOTE).read_text())
    except (OSError, ValueError):
        return 0.0
    return float(note.get("seconds") or 0.0) if run_id and note.get("run_id") == run_id else 0.0
