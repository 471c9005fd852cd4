"""Staging: list every input first, then copy each to compute-local disk.

:func:`preflight` lists every declared input (a file, a folder, or a glob;
sizes and ETags/mtimes) before anything is copied and fails fast naming the
input and its masked URL; the sum is the job's data size.  The ``stage``
task (:func:`stage_input`) then copies one input to
``<data_dir>/<name>/`` (a file keeps its base name, a folder or glob its
tree) through a temporary folder renamed into place only when the copy is
whole and verified (:mod:`e31.tasks.storage.transfer`).  A source changed while being
copied is listed and copied again (up to :data:`ATTEMPTS` times), so a
spliced file is never staged.  A record ``<data_dir>/<name>.stage.json``
keeps the listing's digest (URL hash, every file's size and ETag/mtime) and
the staged copy's identity (:func:`e31.tasks.storage.transfer.identity`: for a folder,
a scan of every name, size and mtime in it): an unchanged input whose copy
is as it was staged is not copied again.
Transient errors (network, throttling) are retried by Prefect with
exponential backoff; a missing input or a sha256 mismatch is not.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.tasks import exponential_backoff

from e31.errors import E31Error
from e31.specs import DataInput, mask_url
from e31.tasks import settings, storage
from e31.tasks.storage import transfer
from e31.tasks.storage.masked_errors import masks_failures
from e31.tasks.storage.scratch_cache import touch_record
from e31.tasks.storage.local import SCRATCH_FIX, disk_full, human_size, mount_point, space
from e31.tasks.supervisor.cancel import staging_gate, staging_stop
from e31.tasks.storage.listing import Listing, OnlyFolders, change_hash, list_input, unchanged
from e31.tasks.retrying import retry_unless
from e31.tasks.stage_errors import final_refusal, not_found, unreachable
from e31.tasks.storage.progress import TransferProgress, TransferStopped

ATTEMPTS = 3  # copies of one input tried when its source changes during the copy or fails verification
RETRIES = settings.value("E31_TRANSFER_RETRIES")  # Prefect retries of a stage task after a transient error
BACKOFF_S = settings.value("E31_TRANSFER_BACKOFF_S")  # first retry delay (s); doubles each retry


class StageError(E31Error, RuntimeError):
    """An input cannot be staged and retrying will not help: missing,
    unreadable, a sha256 mismatch, or a source that keeps changing."""


class CopyFailed(StageError):
    """A copy failed in a way a retry may cure (the network, a server
    error): the stage task retries it; after the last retry it fails the job.
    Its text is masked (a client's error quotes the request's URL)."""


class StagingCancelled(StageError):
    """The flow run was cancelled while this input was being copied (the
    partial copy is removed; the previous staged copy is left as it was)."""


@dataclass(frozen=True)
class Staged:
    """A staged input: local ``path``, ``bytes`` and ``files`` at the source,
    whether it was ``copied`` this time (False: reused from the cache),
    seconds taken."""

    name: str
    path: str
    bytes: int
    copied: bool
    seconds: float
    files: int = 1


@dataclass
class Reused(Listing):
    """An input found staged and unchanged by :func:`quick_reuse` without
    being listed file by file: ``staged`` says what is there (``bytes`` and
    ``files`` are its; ``entries`` is empty)."""

    staged: Staged | None = None

    @property
    def bytes(self) -> int:
        return self.staged.bytes if self.staged else 0

    @property
    def files(self) -> int:
        return self.staged.files if self.staged else 0


def quick_reuse(item: DataInput, data_dir: Path) -> Reused | None:
    """The staged copy of a local folder input, when both the source folder
    and the copy scan now exactly as they did when it was staged (two GNU
    find scans of ctime, inode and name, taken at once, whose sha256 is
    compared with the stage record's: no listing is parsed); None when that
    cannot be said (not a local folder, no such record, no GNU find, or
    anything changed): then list it and compare as usual.

    The check is at least as strict as the listing's: any change to a file
    or folder (content, size, mtime, mode, a rename, a name added or
    removed) moves a ctime, which no process can set back (see
    :data:`e31.tasks.storage.listing.CHANGE_FORMAT`)."""
    started = time.monotonic()
    try:
        saved = json.loads((data_dir / f"{item.name}.stage.json").read_text())
    except (OSError, ValueError):
        return None
    folder = data_dir / item.name
    if saved.get("kind") != "folder" or not saved.get("source_hash") or not saved.get("copy_hash") \
            or saved.get("url") != _url_key(item.url) or saved.get("sha256") != item.sha256 \
            or saved.get("path") != str(folder) or not storage.is_local(item.url):
        return None
    root = storage.filesystem(item.url)[1].rstrip("/") or "/"
    if not os.path.isdir(root):  # the scans below say nothing of the root itself: a file there now has none either
        return None
    with ThreadPoolExecutor(2) as pool:  # two processes: the scans take one core each
        source, copy = pool.submit(change_hash, root), pool.submit(change_hash, str(folder))
        try:
            if (source.result(), copy.result()) != (saved["source_hash"], saved["copy_hash"]):
                return None
        except OSError:
            return None
    touch_record(data_dir / f"{item.name}.stage.json")  # used now: the last to be evicted
    staged = Staged(item.name, str(folder), int(saved.get("bytes", 0)), False, time.monotonic() - started,
                    int(saved.get("files", 0)))
    return Reused(item.url, "folder", [], local=True, root=root, staged=staged)


def _url_key(url: str) -> str:
    # The cache record stores a hash of the URL, never the URL (it may hold credentials).
    return hashlib.sha256(url.encode()).hexdigest()


def list_one(item: DataInput) -> Listing:
    """List one input; raises :class:`StageError` naming it when it is
    missing or unreadable, or declares a sha256 for more than one file."""
    shown = mask_url(item.url)
    try:
        listing = list_input(item.url)
    except OnlyFolders as exc:
        raise StageError(f"data '{item.name}': {shown}: {exc}") from None
    except FileNotFoundError as exc:
        raise StageError(f"data '{item.name}': {shown}: {not_found(exc)}") from None
    except Exception as exc:
        why = unreachable(exc) or f"cannot read ({storage.describe_error(exc)})"
        raise StageError(f"data '{item.name}': {shown}: {why}") from None
    if item.sha256 and listing.kind != "file":
        raise StageError(f"data '{item.name}': {shown}: sha256 is declared but the URL is a {listing.kind} of "
                         f"{len(listing.entries)} file(s); declare sha256 for single files")
    return listing


def preflight(inputs: list[DataInput], data_dir: Path | None = None) -> dict[str, Listing]:
    """List every input before anything is copied; returns ``{name:
    Listing}``.  Raises :class:`StageError` for the first input that is
    missing or unreadable, and -- with ``data_dir`` -- when the scratch disk
    has less free space than the inputs that must be copied (those not
    already staged and unchanged) need; nothing has been copied then."""
    listings: dict[str, Listing] = {}
    for item in inputs:
        reused = quick_reuse(item, Path(data_dir)) if data_dir is not None else None
        listings[item.name] = reused or list_one(item)
    if data_dir is not None:
        needed = sum(listings[item.name].bytes for item in inputs if not isinstance(listings[item.name], Reused)
                     and not staged_now(item, listings[item.name], Path(data_dir)))
        if needed:
            free, _ = space(Path(data_dir))
            if free < needed:
                raise StageError(f"cannot stage the inputs: the scratch disk {mount_point(Path(data_dir))} has "
                                 f"{human_size(free)} free and the inputs to copy need {human_size(needed)} "
                                 f"({needed} bytes); {SCRATCH_FIX}")
    return listings


def staged_now(item: DataInput, listing: Listing, data_dir: Path) -> bool:
    """Whether ``item`` (listed now as ``listing``) is staged under
    ``data_dir`` and unchanged: nothing to copy."""
    folder = data_dir / item.name
    local = folder / listing.entries[0].rel if listing.kind == "file" else folder
    record = {"url": _url_key(item.url), "digest": listing.digest(), "sha256": item.sha256, "path": str(local)}
    return _cached(data_dir / f"{item.name}.stage.json", record, folder, listing)


def stage_input(item: DataInput, data_dir: Path, listing: Listing | None = None) -> Staged:
    """Stage ``item`` under ``data_dir`` (``listing`` from :func:`preflight`,
    else listed now); returns :class:`Staged`.

    Raises :class:`StageError` (names the input and its masked URL) when the
    source is missing, its sha256 differs from the declared one, or it keeps
    changing while being copied; other errors (network) propagate for the
    task's retries.  A failed copy leaves the previous staged copy as it was.
    """
    started = time.monotonic()
    if listing is None:
        listing = quick_reuse(item, data_dir) or list_one(item)
    if isinstance(listing, Reused) and listing.staged is not None:
        return listing.staged  # found staged and unchanged (by preflight, a moment ago, or just now)
    folder = data_dir / item.name
    local = folder / listing.entries[0].rel if listing.kind == "file" else folder
    record_path = data_dir / f"{item.name}.stage.json"
    for attempt in range(1, ATTEMPTS + 1):
        record = {"url": _url_key(item.url), "digest": listing.digest(), "sha256": item.sha256, "path": str(local)}
        if _cached(record_path, record, folder, listing):
            touch_record(record_path)  # used now: the last to be evicted
            return Staged(item.name, str(local), listing.bytes, False, time.monotonic() - started, len(listing.entries))
        tmp = data_dir / f".{item.name}.part-{uuid.uuid4().hex[:8]}"
        try:
            with TransferProgress(f"stage-{item.name}", listing.bytes, len(listing.entries),
                                  stop=staging_stop(str(data_dir)), gate=staging_gate(str(data_dir))) as progress:
                checked = transfer.fetch(listing, tmp, progress)
            transfer.make_read_only(listing, tmp)  # the work reads its inputs; it must not change them
            quick = listing.kind == "folder" and bool(listing.scan)  # a local folder: kept for quick_reuse
            # taken before the source is listed again below: a change after the listing shows there
            source_hash = change_hash(listing.root) if quick else None
            with ThreadPoolExecutor(2) as pool:  # list the source again while the copy is checked
                again = pool.submit(_changed_since_listed, item, listing)
                copy_hash = pool.submit(change_hash, str(tmp)) if quick else None
                staged_identity = transfer.verify(listing, tmp, checked)
                changed = again.result()
                copy_hash = copy_hash.result() if copy_hash is not None else None
            if changed:
                raise transfer.ChangedWhileCopying(changed)
            if item.sha256:
                _check_sha256(item, tmp / listing.entries[0].rel)
        except (transfer.ChangedWhileCopying, transfer.VerifyError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if attempt == ATTEMPTS:
                raise StageError(f"data '{item.name}': {mask_url(item.url)}: {exc} "
                                 f"({ATTEMPTS} attempts); stage it again when the source is stable") from None
            _log(f"stage {item.name}: {exc}; listing and copying again (attempt {attempt + 1} of {ATTEMPTS})")
            listing = list_one(item)
            local = folder / listing.entries[0].rel if listing.kind == "file" else folder
            continue
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, TransferStopped) or isinstance(exc.__cause__ or exc.__context__, TransferStopped):
                raise StagingCancelled(f"data '{item.name}': staging stopped: the flow run was cancelled") from None
            full = disk_full(data_dir, exc, needed=listing.bytes) if isinstance(exc, OSError) else None
            if full:
                raise StageError(f"data '{item.name}': cannot stage it: {full}") from None
            why = final_refusal(exc) if isinstance(exc, Exception) else None
            if why:
                raise StageError(f"data '{item.name}': {mask_url(item.url)}: {why}") from None
            raise
        record_path.unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        record.update(staged=staged_identity, bytes=listing.bytes, files=listing.files)  # sizes: for eviction
        if source_hash and copy_hash:  # what quick_reuse compares
            record.update(kind="folder", source_hash=source_hash, copy_hash=copy_hash)
        _write_record(record_path, record, folder, data_dir, item)
        return Staged(item.name, str(local), listing.bytes, True, time.monotonic() - started, len(listing.entries))
    raise AssertionError("unreachable")


def _write_record(path: Path, record: dict, folder: Path, data_dir: Path, item: DataInput) -> None:
    """Write the stage record whole (a temporary file renamed into place);
    when it cannot be written (a full disk), the copy goes too, so no copy
    without its record strands the space, and :class:`StageError` says why."""
    tmp = path.with_name(f".{path.name}.part-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        full = disk_full(data_dir, exc)
        raise StageError(f"data '{item.name}': cannot record the staged copy: {full or exc}") from None


def _changed_since_listed(item: DataInput, listing: Listing) -> list[str]:
    """The files of ``item`` that changed since ``listing`` was made (see
    :func:`e31.tasks.storage.transfer.changed_since`); a local folder whose scan is
    byte-for-byte the same is not parsed again."""
    if unchanged(listing):
        return []
    return transfer.changed_since(listing, list_one(item))


def _check_sha256(item: DataInput, path: Path) -> None:
    got = storage.sha256_file(path)
    if got != item.sha256:
        raise StageError(
            f"data '{item.name}': sha256 mismatch: declared {item.sha256}, staged file has {got}. "
            "Fix: update data[].sha256 if the input changed on purpose."
        )


def _cached(record_path: Path, record: dict, folder: Path, listing: Listing) -> bool:
    try:
        saved = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return False
    staged = saved.pop("staged", None)
    return all(saved.get(k) == v for k, v in record.items()) and staged is not None and \
        staged == transfer.identity(listing, folder)


def _log(line: str) -> None:
    try:
        get_run_logger().warning("%s", line)
    except Exception:
        pass


@task(name="stage", retries=RETRIES, retry_delay_seconds=exponential_backoff(backoff_factor=BACKOFF_S),
      retry_jitter_factor=0.5, retry_condition_fn=retry_unless(StageError, but=(CopyFailed,)), cache_policy=NO_CACHE)
@masks_failures
def stage_task(item: DataInput, data_dir: str, listing: Listing | None = None) -> Staged:
    """Prefect task wrapper of :func:`stage_input`; logs what was copied, at
    what rate.  Retried (``E31_TRANSFER_RETRIES``, default 3, backoff from
    ``E31_TRANSFER_BACKOFF_S`` = 2 s doubling) after transient errors, each
    raised as :class:`CopyFailed` naming the input (masked, with nothing
    chained: its text becomes the task run's state message)."""
    try:
        result = stage_input(item, Path(data_dir), listing)
    except StageError:
        raise
    except Exception as exc:
        why = unreachable(exc) or f"cannot copy it ({storage.describe_error(exc)})"
        failure = CopyFailed(f"data '{item.name}': {mask_url(item.url)}: {why}")
    else:
        failure = None
    if failure is not None:
        raise failure  # (outside the handler: the client's error, with its URL, is not chained to it)
    if result.copied:
        rate = result.bytes / max(result.seconds, 1e-9) / 2**20
        get_run_logger().info("staged %s: %d file(s), %d bytes in %.2f s (%.1f MiB/s)", item.name, result.files,
                              result.bytes, result.seconds, rate)
    else:
        get_run_logger().info("%s unchanged (%d file(s), %d bytes): reused the staged copy in %.2f s", item.name,
                              result.files, result.bytes, result.seconds)
    return result
