"""Sharded checkpoints: each rank of a job saves its own part with ``torch.distributed.checkpoint``.

A model too large for one rank's memory -- FSDP, tensor parallelism, any ``DTensor`` -- is saved by
every rank at once with ``torch.distributed.checkpoint.save`` (DCP), each rank writing only its shards:
``__<rank>_<n>.distcp``, and rank 0 also ``.metadata`` (the index of every shard).  On E31 each rank
writes into its own node's ``step-<N>/`` (:func:`save`), so one node holds one part of the checkpoint.

What makes the parts one checkpoint:

1. each rank's part is committed on its node like any checkpoint (:mod:`.local_checkpoints`), its marker
   carrying ``"sharded": {"rank", "world_size", "token", "shards"}`` -- ``shards`` every file of the whole
   checkpoint, as DCP's metadata names them, ``token`` the try of the job's work that wrote it;
2. each rank's process uploads its part to ``<checkpoint URL>/step-<N>/`` and then its part note,
   ``.rank-<rank>.json`` (:func:`e31.tasks.checkpoint.upload`);
3. the lead (rank 0) writes the step's ``COMMITTED`` marker, last, only once the part notes of every rank
   of its own try are there and together name every shard (:func:`e31.tasks.checkpoint.seal`).  A part
   from an earlier try -- a member fenced off, a step an earlier attempt also reached -- never counts;
4. a resume fetches the whole step folder on every rank (:func:`e31.flows.resume.resume_step` on the
   lead, the member's own fetch elsewhere) and loads it with :func:`load`; DCP reads each rank's slice from
   whichever files hold it, so the same checkpoint also loads on other nodes, or another sharding.

One rank's folder is never taken for a whole checkpoint
(:func:`e31.tasks.work.local_checkpoints.missing_shards`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from e31.tasks.storage.local import regular_files
from e31.tasks.work.local_checkpoints import MARKER, PENDING, step_dir_name
from e31.tasks.work.state import CheckpointError

__all__ = ["METADATA", "load", "part_note_name", "save"]

#: The metadata file DCP's ``FileSystemWriter`` writes on rank 0: the index of every shard.
METADATA = ".metadata"


def part_note_name(rank: int) -> str:
    """The name of rank ``rank``'s part note in a step folder at the checkpoint URL (``.rank-<rank>.json``)."""
    return f".rank-{int(rank)}.json"


def save(root: Path, state: dict[str, Any], step: int, rank: int = 0, world_size: int = 1,
         token: str | None = None) -> Path:
    """Save ``state`` (a ``state_dict``: tensors, ``DTensor``/``ShardedTensor`` and plain values) as this
    rank's part of the checkpoint of ``step``, in ``root/step-<N>/``, with
    ``torch.distributed.checkpoint.save``: a collective, so every rank of the job calls it with the same
    ``step`` (with no process group, as on one node, it saves the whole state).  Then writes the folder's
    ``PENDING`` note (files and sizes, and ``"sharded"``: ``rank``, ``world_size``, ``token``, every file
    of the whole checkpoint), which makes the folder ready to commit.  Returns the folder.

    Raises :class:`CheckpointError` when DCP cannot save ``state`` (its text included)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    folder = Path(root) / step_dir_name(step)
    try:
        if folder.exists():
            shutil.rmtree(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        metadata = dcp.save(state, checkpoint_id=str(folder))
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"sharded checkpoint of step {int(step)} could not be saved: {_why(exc)}") from None
    shards = sorted({info.relative_path for info in (metadata.storage_data or {}).values()} | {METADATA})
    files = {rel: {"bytes": path.stat().st_size} for path, rel in regular_files(folder, skip=(MARKER, PENDING))[0]}
    note = {"step": int(step), "files": files,
            "sharded": {"rank": int(rank), "world_size": int(world_size), "token": token, "shards": shards}}
    tmp = folder / f".{PENDING}"
    tmp.write_text(json.dumps(note))
    os.replace(tmp, folder / PENDING)
    return folder


def load(folder: Path, state: dict[str, Any]) -> None:
    """Load the whole sharded checkpoint in ``folder`` into ``state`` in place
    (``torch.distributed.checkpoint.load``: each tensor of ``state`` gets its own slice, whatever sharding
    saved it).  A collective when a process group is set up: every rank calls it.  Raises
    :class:`CheckpointError` when ``folder`` holds no sharded checkpoint (it was saved with
    ``ctx.checkpoint``) or DCP cannot load it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if not (Path(folder) / METADATA).is_file():
        raise CheckpointError(f"checkpoint {Path(folder).name} was not saved with ctx.checkpoint_sharded "
                              "(no .metadata): restore it with ctx.restore()")
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"sharded checkpoint {Path(folder).name} could not be loaded: {_why(exc)}") from None


def _why(exc: BaseException) -> str:
    """One line for what DCP raised.  Its ``CheckpointException`` derives from ``BaseException`` (so an
    ``except Exception`` in the work would not catch it) and carries each failed rank's exception with a
    traceback: said here as ``rank N: Type: text`` per rank, the disk full named where it is."""
    from e31.tasks.storage.local import disk_full

    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(exc).__name__}: {exc}"
    said = []
    for rank, pair in sorted(failures.items()):
        err = pair[0] if isinstance(pair, tuple) else pair
        full = disk_full(Path(getattr(err, "filename", "") or "."), err) if isinstance(err, OSError) else None
        said.append(f"rank {rank}: {full or f'{type(err).__name__}: {err}'}")
    return "; ".join(said)
