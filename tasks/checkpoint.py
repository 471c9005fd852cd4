"""The ``checkpoint`` task: make a locally committed checkpoint durable.

Uploads the files of ``step-<N>/`` with fsspec to ``<durable>/step-<N>/``
(each published whole and verified: :func:`e31.tasks.storage.publish_file`),
marker last, then keeps only the newest ``keep`` durable checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from prefect import task

from e31.specs import mask_url
from e31.tasks import storage
from e31.tasks.retrying import retry_unless
from e31.tasks.storage.local import regular_files
from e31.tasks.work.local_checkpoints import MARKER, PENDING, parse_step, step_dir_name, verify
from e31.tasks.work.state import CheckpointError
from e31.tasks.storage.masked_errors import masks_failures


@dataclass(frozen=True)
class DurableCheckpoint:
    """A verified checkpoint on durable storage: its ``step``, ``url``,
    total size in ``bytes``, the ``work_sha256`` of the work that wrote it
    and the flow run (``run_id``) that made it durable (None when unknown)."""

    step: int
    url: str
    bytes: int
    work_sha256: str | None = None
    run_id: str | None = None


def upload(local_dir: Path, durable_root: str, keep: int, work_sha256: str | None = None,
           run_id: str | None = None) -> DurableCheckpoint:
    """Upload one committed local checkpoint folder and prune old ones.

    Returns the :class:`DurableCheckpoint`.  Raises
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
    marker = {**marker, "work_sha256": work_sha256, "run_id": run_id}  # a changed work never resumes from it
    storage.write_bytes(storage.join(target, MARKER), json.dumps(marker, indent=1, sort_keys=True).encode())
    prune(durable_root, keep)
    return DurableCheckpoint(step=step, url=target, bytes=total, work_sha256=work_sha256, run_id=run_id)


def prune(durable_root: str, keep: int) -> list[int]:
    """Delete the committed durable ``step-<N>`` folders (``COMMITTED``
    marker present) older than the newest ``keep``; returns the deleted
    steps.  Folders without the marker are never E31's whole checkpoints
    and are left alone."""
    steps = sorted(s for s in (parse_step(n) for n in storage.list_dirs(durable_root)) if s is not None)
    committed = [s for s in steps if storage.exists(storage.join(durable_root, step_dir_name(s), MARKER))]
    if len(committed) <= keep:
        return []
    doomed = committed[:-keep]
    for s in doomed:
        storage.remove(storage.join(durable_root, step_dir_name(s)))
    return doomed


def latest_durable(durable_root: str) -> DurableCheckpoint | None:
    """The newest durable checkpoint whose marker is present, or None."""
    steps = sorted((s for s in (parse_step(n) for n in storage.list_dirs(durable_root)) if s is not None), reverse=True)
    for s in steps:
        url = storage.join(durable_root, step_dir_name(s))
        try:
            marker = json.loads(storage.read_bytes(storage.join(url, MARKER)))
            size = sum(int(m["bytes"]) for m in marker["files"].values())
        except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
            continue  # no marker, or not one E31 wrote
        return DurableCheckpoint(step=s, url=url, bytes=size, work_sha256=marker.get("work_sha256"),
                                 run_id=marker.get("run_id"))
    return None


@task(name="checkpoint", retries=2, retry_delay_seconds=[1, 5],
      retry_condition_fn=retry_unless(CheckpointError, ValueError))
@masks_failures
def checkpoint_task(local_dir: Path, durable_root: str, keep: int, work_sha256: str | None = None,
                    run_id: str | None = None) -> DurableCheckpoint:
    """Prefect task wrapper of :func:`upload` (retried twice after a store
    error; never for a refused or torn checkpoint)."""
    return upload(Path(local_dir), durable_root, keep, work_sha256, run_id)
