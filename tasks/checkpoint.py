"""The ``checkpoint`` task: make a locally committed checkpoint durable.

Uploads the files of ``step-<N>/`` with fsspec to ``<durable>/step-<N>/``
(each published whole and verified: :func:`e31.tasks.storage.publish_file`),
marker last, then keeps only the newest ``keep`` durable checkpoints.  One rank's
part of a sharded checkpoint is published with its part note instead, and the
lead writes the marker once every rank's part is there (:func:`seal`;
:mod:`e31.tasks.work.sharded`).
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prefect import task

from e31.specs import mask_url
from e31.tasks import storage
from e31.tasks.retrying import retry_unless
from e31.tasks.storage.local import regular_files
from e31.tasks.work.local_checkpoints import MARKER, PENDING, missing_shards, parse_step, step_dir_name, verify
from e31.tasks.work.sharded import part_note_name
from e31.tasks.work.state import CheckpointError
from e31.tasks.storage.masked_errors import masks_failures


_PART_NOTE = re.compile(r"^\.rank-\d+\.json$")


@dataclass(frozen=True)
class DurableCheckpoint:
    """A verified checkpoint on durable storage: its ``step``, ``url``,
    total size in ``bytes``, the ``work_sha256`` of the work that wrote it
    and the flow run (``run_id``) that made it durable (None when unknown).
    ``whole`` False: one rank's part of a sharded checkpoint, published, whose
    step is not whole yet (no marker: :func:`seal`)."""

    step: int
    url: str
    bytes: int
    work_sha256: str | None = None
    run_id: str | None = None
    whole: bool = True


def upload(local_dir: Path, durable_root: str, keep: int, work_sha256: str | None = None,
           run_id: str | None = None) -> DurableCheckpoint:
    """Upload one committed local checkpoint folder and prune old ones.

    One rank's part of a sharded checkpoint (its marker names shards it
    lacks) is published with its part note (``.rank-<rank>.json``: its files'
    sizes and sha256, its try and every shard's name) in place of the marker;
    rank 0 then tries to :func:`seal` the step.  Returns the
    :class:`DurableCheckpoint` (``whole`` False for a part whose step is not
    sealed yet).  Raises
    :class:`storage.VerifyError` when the read-back hash differs,
    :class:`CheckpointError` when a file may not leave the job (a link out
    of the folder, a hard link, a device), and ``ValueError`` when
    ``local_dir`` is not a whole committed checkpoint.
    """
    marker = verify(local_dir)
    if marker is None:
        refused = regular_files(local_dir, skip=(MARKER, PENDING))[1]
        if refused:
            raise CheckpointError(f"checkpoint {local_dir.name} refused, not uploaded: " + "; ".join(refused))
        raise ValueError(f"{local_dir} is not a committed checkpoint (marker missing or hashes differ)")
    step = parse_step(local_dir.name)
    target = storage.join(durable_root, step_dir_name(step))
    total = 0
    for name, meta in marker["files"].items():
        url = storage.join(target, name)
        try:
            size, _ = storage.publish_file(local_dir / name, url, sha256=meta["sha256"])
        except storage.VerifyError as exc:
            raise storage.VerifyError(f"{mask_url(url)}: {exc}") from None
        if size != meta["bytes"]:
            raise storage.VerifyError(f"{mask_url(url)}: {size} bytes uploaded, the marker says {meta['bytes']}")
        total += size
    if missing_shards(marker):
        sharded = marker["sharded"]
        note = {"step": step, "files": marker["files"], **sharded}
        storage.write_bytes(storage.join(target, part_note_name(sharded["rank"])), json.dumps(note).encode())
        if int(sharded["rank"]) == 0:
            sealed = seal(durable_root, step, keep, work_sha256, run_id)
            if sealed is not None:
                return sealed
        return DurableCheckpoint(step=step, url=target, bytes=total, work_sha256=work_sha256, run_id=run_id,
                                 whole=False)
    marker = {**marker, "work_sha256": work_sha256, "run_id": run_id}  # a changed work never resumes from it
    storage.write_bytes(storage.join(target, MARKER), json.dumps(marker, indent=1, sort_keys=True).encode())
    prune(durable_root, keep)
    return DurableCheckpoint(step=step, url=target, bytes=total, work_sha256=work_sha256, run_id=run_id)


def seal(durable_root: str, step: int, keep: int, work_sha256: str | None = None,
         run_id: str | None = None) -> DurableCheckpoint | None:
    """Write the marker of the sharded checkpoint of ``step`` at ``durable_root`` when it is whole: the
    part notes of ranks ``0..world_size-1`` are all there, all of rank 0's try (``token``), and together
    name every file DCP's metadata lists; the marker names each file's size and sha256 from its part note.
    Then prunes to the newest ``keep``.  Returns the :class:`DurableCheckpoint`, or None while a part is
    missing.  Called by the lead only (rank 0's process)."""
    target = storage.join(durable_root, step_dir_name(step))
    try:
        lead = json.loads(storage.read_bytes(storage.join(target, part_note_name(0))))
        parts = [lead] + [json.loads(storage.read_bytes(storage.join(target, part_note_name(rank))))
                          for rank in range(1, int(lead["world_size"]))]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    files: dict = {}
    for part in parts:
        if not isinstance(part, dict) or part.get("token") != lead.get("token") or part.get("step") != step:
            return None  # a part of another try (a fenced member, an earlier attempt at the same step)
        files.update(part.get("files") or {})
    sharded = {k: lead.get(k) for k in ("world_size", "token", "shards")}
    marker = {"step": step, "files": files, "sharded": sharded, "work_sha256": work_sha256, "run_id": run_id}
    if missing_shards(marker):
        return None
    storage.write_bytes(storage.join(target, MARKER), json.dumps(marker, indent=1, sort_keys=True).encode())
    prune(durable_root, keep)
    return DurableCheckpoint(step=step, url=target, bytes=sum(int(m["bytes"]) for m in files.values()),
                             work_sha256=work_sha256, run_id=run_id)


def prune(durable_root: str, keep: int) -> list[int]:
    """Delete the committed durable ``step-<N>`` folders (``COMMITTED``
    marker present) older than the newest ``keep``, and the folders of
    sharded steps never sealed (rank 0's part note, no marker) older than
    the newest committed one; returns the deleted steps.  Other folders
    without the marker are never E31's checkpoints and are left alone."""
    steps = sorted(s for s in (parse_step(n) for n in storage.list_dirs(durable_root)) if s is not None)
    committed = [s for s in steps if storage.exists(storage.join(durable_root, step_dir_name(s), MARKER))]
    doomed = committed[:-keep] if len(committed) > keep else []
    if committed:
        doomed += [s for s in steps if s < committed[-1] and s not in committed
                   and holds_part(storage.join(durable_root, step_dir_name(s)))]
    for s in sorted(doomed):
        storage.remove(storage.join(durable_root, step_dir_name(s)))
    return sorted(doomed)


def fetch_newest(local_root: Path, durable_root: str, work_sha256: str | None, above: int | None = None,
                 accept: Callable[[DurableCheckpoint], bool] = lambda durable: True,
                 rejected: list[str] | None = None) -> int | None:
    """Fetch the newest durable checkpoint at ``durable_root`` of the work ``work_sha256`` (newer than step
    ``above``, and that ``accept`` takes) into ``local_root`` as a whole, verified checkpoint; returns its
    step, or None when none is.  A step whose files do not verify once fetched (a file changed or cut at
    the store) is removed here and the next older one tried; each is said in ``rejected``.  Raises what the
    store raises."""
    import shutil

    from e31.tasks.work.local_checkpoints import latest_valid

    for durable in durable_checkpoints(durable_root):
        if above is not None and durable.step <= above:
            return None
        if durable.work_sha256 != work_sha256 or not accept(durable):
            return None
        target = Path(local_root) / step_dir_name(durable.step)
        shutil.rmtree(target, ignore_errors=True)
        storage.get(durable.url, target)
        got = latest_valid(local_root)
        if got is not None and got.step == durable.step:
            return durable.step
        shutil.rmtree(target, ignore_errors=True)
        if rejected is not None:
            rejected.append(f"the checkpoint of step {durable.step} at {storage.scrub(durable.url)} does not verify "
                            "(a file's size or sha256 differs from its marker): skipped")
    return None


def fetch_sharded(local_root: Path, durable_root: str, work_sha256: str | None,
                  rejected: list[str] | None = None) -> int | None:
    """Before a try of a gang's work: when the newest checkpoint under ``local_root`` is this rank's part
    of a sharded checkpoint (never whole on one node), drop the parts newer than the newest whole one here
    (the work's next checkpoints follow the step it resumes from) and fetch the newest whole checkpoint of
    the same work newer than that from ``durable_root`` (:func:`fetch_newest`).  Returns the step fetched,
    or None (nothing to do, or nothing newer at ``durable_root``).  Raises what the store raises."""
    import shutil

    from e31.tasks.work.local_checkpoints import committed, latest_valid

    local = latest_valid(local_root)
    newer = [c for c in committed(local_root) if local is None or c.step > local.step]
    if not newer:
        return None
    for ckpt in newer:
        shutil.rmtree(ckpt.path, ignore_errors=True)
    return fetch_newest(local_root, durable_root, work_sha256, local.step if local is not None else None,
                        rejected=rejected)


def holds_part(step_url: str) -> bool:
    """Whether the step folder at ``step_url`` holds a rank's part note (:mod:`e31.tasks.work.sharded`):
    a sharded checkpoint of E31's, whole or not."""
    fs, path = storage.filesystem(step_url)
    try:
        names = [posixpath.basename(str(n).rstrip("/")) for n in fs.ls(path, detail=False)]
    except (FileNotFoundError, NotADirectoryError):
        return False
    return any(_PART_NOTE.match(name) for name in names)


def durable_checkpoints(durable_root: str) -> Iterator[DurableCheckpoint]:
    """The durable checkpoints at ``durable_root`` whose marker is present, newest first (one listing,
    then one marker read per checkpoint taken)."""
    steps = sorted((s for s in (parse_step(n) for n in storage.list_dirs(durable_root)) if s is not None), reverse=True)
    for s in steps:
        url = storage.join(durable_root, step_dir_name(s))
        try:
            marker = json.loads(storage.read_bytes(storage.join(url, MARKER)))
            size = sum(int(m["bytes"]) for m in marker["files"].values())
        except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
            continue  # no marker, or not one E31 wrote
        yield DurableCheckpoint(step=s, url=url, bytes=size, work_sha256=marker.get("work_sha256"),
                                run_id=marker.get("run_id"))


def latest_durable(durable_root: str) -> DurableCheckpoint | None:
    """The newest durable checkpoint whose marker is present, or None."""
    return next(durable_checkpoints(durable_root), None)


@task(name="checkpoint", retries=2, retry_delay_seconds=[1, 5],
      retry_condition_fn=retry_unless(CheckpointError, ValueError))
@masks_failures
def checkpoint_task(local_dir: Path, durable_root: str, keep: int, work_sha256: str | None = None,
                    run_id: str | None = None) -> DurableCheckpoint:
    """Prefect task wrapper of :func:`upload` (retried twice after a store
    error; never for a refused or torn checkpoint)."""
    return upload(Path(local_dir), durable_root, keep, work_sha256, run_id)
