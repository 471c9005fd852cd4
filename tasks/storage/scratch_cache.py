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
- the transfer markers (:mod:`e31.tasks.storage.transfer_markers`): a
  marker per flow run that is starting, staging or returning on this
  machine; the prefetcher pauses while one exists, so it never slows a job
  that holds its resources (nodes sharing a machine share its network and disks).
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

from e31.tasks.storage.transfer_markers import alive

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
_WAITED: dict[str, float] = {}  # job scratch folder -> seconds take_data waited for a prefetch to yield
#: Seconds a flow run waits for a prefetch of its job to yield before it kills the prefetcher (whose copies
#: are atomic: a kill leaves nothing a run reuses; ``e31 worker`` starts it again).
YIELD_S = 5.0
#: What a prefetcher's command line holds (a holder :func:`take_data` may kill is checked for it).
PREFETCHER = b"e31.deployments.prefetch"


def _mark_holder(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)


def take_data(scratch: str | os.PathLike[str], yield_s: float = YIELD_S) -> float:
    """Hold the job's data folder (``scratch`` is ``<root>/<job>``) for a
    flow run, until :func:`release_data` (or this process's death).  A
    prefetch holding it is asked to yield (``data.wanted``, naming this
    process) and stops within a chunk of its transfer; one that has not
    let go after ``yield_s`` seconds (a source that stopped sending) is
    killed -- only a process whose command line is the prefetcher's.
    Returns the seconds waited (0.0 at once); never raises for a busy lock."""
    scratch = Path(scratch)
    fd = _lock_fd(scratch)
    started = time.monotonic()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        wanted = scratch / WANTED
        wanted.write_text(str(os.getpid()))
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pass
                if time.monotonic() - started > yield_s:
                    _kill_prefetcher(fd)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    break
                time.sleep(0.05)
        finally:
            wanted.unlink(missing_ok=True)
    _mark_holder(fd)
    old = _HELD.pop(str(scratch), None)
    if old is not None:
        os.close(old)
    _HELD[str(scratch)] = fd
    _WAITED[str(scratch)] = waited = time.monotonic() - started
    return waited


def _kill_prefetcher(fd: int) -> None:
    """SIGKILL the holder named in the lock file when it is a prefetcher."""
    import signal

    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    if not text.isdigit() or int(text) == os.getpid():
        return
    try:
        cmdline = Path(f"/proc/{text}/cmdline").read_bytes()
    except OSError:
        return
    if PREFETCHER in cmdline:
        try:
            os.kill(int(text), signal.SIGKILL)
        except OSError:
            pass


def data_wait_s(scratch: str | os.PathLike[str]) -> float:
    """Seconds the last :func:`take_data` of ``scratch`` in this process waited (0.0: none)."""
    return _WAITED.get(str(Path(scratch)), 0.0)


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
        _mark_holder(fd)
        yield True
    finally:
        os.close(fd)


def yield_wanted(scratch: str | os.PathLike[str]) -> bool:
    """Whether a flow run of the job waits for the data folder (a prefetch
    holding it must stop).  A request left by a process that died is
    removed and does not count."""
    wanted = Path(scratch) / WANTED
    try:
        text = wanted.read_text().strip()
    except OSError:
        return False
    if text.isdigit() and alive(int(text)):
        return True
    wanted.unlink(missing_ok=True)
    return False


def data_in_use(scratch: str | os.PathLike[str]) -> bool:
    """Whether a flow run or a prefetch holds the job's data folder now (a
    probe that takes and drops the lock at once; the folder is not made)."""
    fd = _held_now(Path(scratch))
    if fd is None:
        return True
    if fd >= 0:
        os.close(fd)
    return False


def _held_now(scratch: Path) -> int | None:
    """Take the job's data lock if free: its descriptor (-1: no lock file,
    so nobody holds it), or None when someone holds it."""
    try:
        fd = os.open(scratch / LOCK, os.O_RDWR)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def staged_copies(root: str | os.PathLike[str]) -> list[StagedCopy]:
    """Every staged input under the scratch root ``root``, least recently
    used first: a copy without its record (a staging killed between the
    two, or whose record could not be written) counts as the oldest, since
    no run reuses it.  Sizes come from the records (``bytes``), else from a
    walk of the copy."""
    found = []
    root = Path(root)
    try:
        jobs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []
    for job in jobs:
        data = job / "data"
        try:
            names = [p for p in data.iterdir() if not p.name.startswith(".")]
        except OSError:
            continue
        records = [p for p in names if p.name.endswith(".stage.json")]
        recorded = {p.name[:-len(".stage.json")] for p in records}
        for orphan in (p for p in names if p.is_dir() and p.name not in recorded):  # its record never written
            found.append(StagedCopy(job.name, orphan.name, orphan, _size(orphan), 0.0))  # no run reuses it: first out
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
    never those of the jobs named in ``keep`` or of a job whose data folder
    is in use (a run or a prefetch holds it: each chosen copy's folder is
    held, as a prefetch holds it, until its copy is removed, so a run that
    starts meanwhile waits and then stages it again).  Each copy goes record
    first, then its folder, so a kill in between leaves a folder no run
    reuses (a copy without its record is staged again).  Returns ``(fits,
    evicted)``; when it cannot fit, nothing is removed."""
    copies = staged_copies(root)
    total = sum(c.bytes for c in copies)
    if total + need <= budget:
        return True, []
    chosen, held, freed = [], {}, 0
    try:
        for copy in copies:
            if copy.job in keep:
                continue
            folder = Path(root) / copy.job
            if str(folder) not in held:
                fd = _held_now(folder)
                if fd is None:  # in use
                    continue
                held[str(folder)] = fd
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
    finally:
        for fd in held.values():
            if fd >= 0:
                os.close(fd)


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
