"""The on-disk checkpoint format shared by the work (child process) and the
supervisor.

A checkpoint is a folder ``step-<N>/`` holding one or more files and, written
last, a marker file ``COMMITTED`` (JSON: ``{"step": N, "files": {name:
{"bytes": int, "sha256": hex}}}``).  A folder without its marker, or whose
files do not match the marker's hashes, is not a checkpoint and is ignored.

Writes are atomic and split in two so the work pays only for serialising:
1. :func:`write_state` (the work's process): ``torch.save`` into
   ``step-<N>/``, then a ``PENDING`` note of the files' sizes, written only
   once every byte is -- or, under a supervisor, one file
   ``step-<N>.handoff`` in the cheaper raw form of :mod:`e31.tasks.work.handoff`,
   renamed into place when whole.  No fsync and no hashing here.
2. :func:`commit_pending` / :func:`commit` (the supervisor's process, or
   inline without one): turn a hand-over file into ``step-<N>/state.pt``
   with ``torch.save``, check the sizes, fsync the files and folders, hash
   them, then write the
   ``COMMITTED`` marker (sha256 of each file) under a temporary name, fsync
   it and rename it into place.
A folder without ``COMMITTED`` never counts.  A kill at any moment leaves a
folder without its note (removed at the next start), a noted folder
(committed by the supervisor, which outlives the work), or a whole
checkpoint.  States are saved with ``torch.save`` and read back
with ``torch.load(weights_only=True)`` only: tensors and plain values.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e31.tasks.work import handoff as handoff_format
from e31.tasks.storage.local import disk_full, fsync_path, regular_files, sha256_file
from e31.tasks.work.state import CheckpointError, load_state, snapshot  # noqa: F401 (re-exported for the work and tests)

MARKER = "COMMITTED"
PENDING = "PENDING"
STATE_FILE = "state.pt"
HANDOFF_SUFFIX = ".handoff"  # step-<N>.handoff: an uncommitted state in the raw form of e31.tasks.work.handoff
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class LocalCheckpoint:
    """A committed checkpoint folder on local disk: ``path`` and ``step``."""

    path: Path
    step: int


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint for ``step`` (``step-<N>``)."""
    return f"step-{int(step)}"


def parse_step(name: str) -> int | None:
    """Step number of a ``step-<N>`` folder name, or None for other names."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def describe_files(folder: Path) -> dict[str, dict[str, Any]]:
    """``{relative name: {"bytes": int, "sha256": hex}}`` for each file in
    ``folder`` except the marker and the pending note.  Raises
    :class:`CheckpointError` naming a file that may not leave the job (a
    link out of the folder, a hard link, a FIFO or device: the rule of
    output files, :func:`e31.tasks.storage.local.regular_files`)."""
    files, refused = regular_files(folder, skip=(MARKER, PENDING))
    if refused:
        raise CheckpointError(f"checkpoint {folder.name} refused: " + "; ".join(refused))
    return {rel: {"bytes": path.stat().st_size, "sha256": sha256_file(path)} for path, rel in files}


def write_marker(folder: Path, step: int, files: dict[str, dict[str, Any]] | None = None,
                 sharded: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the ``COMMITTED`` marker of ``folder`` atomically, with ``files``
    (``{name: {"bytes", "sha256"}}``; hashed from disk when None) and, for one
    rank's part of a sharded checkpoint, ``sharded`` (see :func:`missing_shards`);
    returns the marker's content."""
    marker: dict[str, Any] = {"step": int(step), "files": files if files is not None else describe_files(folder)}
    if sharded:
        marker["sharded"] = sharded
    tmp = folder / f".{MARKER}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(marker, indent=1, sort_keys=True))
    fsync_path(tmp)
    os.replace(tmp, folder / MARKER)
    fsync_path(folder)
    return marker


def write_state(root: Path, state: dict[str, Any], step: int, handoff: bool = False) -> Path:
    """Write ``state`` as the uncommitted checkpoint of ``step`` under ``root``
    (step 1 above); returns the folder ``root/step-<N>`` it is (or will be,
    once committed) in.

    ``state`` must hold tensors and plain values only (see :func:`snapshot`);
    anything else is refused with :class:`CheckpointError` before a file is
    written.  An existing checkpoint of the same step is replaced.
    ``handoff`` (the work's process under a supervisor): write the single
    file ``step-<N>.handoff`` in the raw form of :mod:`e31.tasks.work.handoff` (about
    half the work's time of ``torch.save``), which :func:`commit_pending`
    turns into the folder with ``torch.save``'s file; states that form would
    not keep exactly are saved with ``torch.save`` at once.
    """
    final = root / step_dir_name(step)
    encoded = None
    if handoff:
        try:
            encoded = handoff_format.encode(state)
        except handoff_format.NotPlain:
            snapshot(state, copy=False)  # raises CheckpointError naming the entry
        except handoff_format.NotHandedOver:
            pass
    else:
        snapshot(state, copy=False)  # refuse what weights_only loading could not read
    if final.exists():
        shutil.rmtree(final)
    if encoded is not None:
        try:
            handoff_format.write_file(handoff_path(final), encoded)
        except FileNotFoundError:  # the first checkpoint: no folder yet (one mkdir, not one per checkpoint)
            root.mkdir(parents=True, exist_ok=True)
            handoff_format.write_file(handoff_path(final), encoded)
        return final
    import torch

    final.mkdir(parents=True)
    with open(final / STATE_FILE, "wb") as fh:
        torch.save(state, fh)
        size = fh.tell()
    # The note is written only once every byte of the state is: it marks the folder whole.
    note = final / f".{PENDING}"
    note.write_text(json.dumps({"step": int(step), "files": {STATE_FILE: {"bytes": size}}}))
    os.replace(note, final / PENDING)
    return final


def handoff_path(folder: Path) -> Path:
    """The hand-over file of the checkpoint folder ``folder`` (``step-<N>``
    -> ``step-<N>.handoff`` beside it)."""
    return folder.with_name(folder.name + HANDOFF_SUFFIX)


def written(folder: Path) -> bool:
    """Whether the checkpoint of ``folder`` exists in any state: committed,
    noted, being written, or handed over.

    The hand-over file is looked at first: the supervisor makes the folder
    before it removes that file, so a conversion finishing between the two
    looks is still seen (the other order could see neither)."""
    return handoff_path(folder).is_file() or folder.is_dir()


def _convert_handoff(folder: Path) -> bool:
    """Turn ``step-<N>.handoff`` into the folder ``step-<N>/`` holding
    ``state.pt`` (``torch.save``, fsynced, renamed into place) and its
    ``PENDING`` note, then remove the hand-over file; returns whether the
    folder is ready to commit.  A conversion interrupted at any point is
    redone; a hand-over file that is not whole, or names anything outside
    the allow-list, is removed (False)."""
    import torch

    raw = handoff_path(folder)
    if (folder / PENDING).is_file() or (folder / MARKER).is_file():  # converted before an interruption
        raw.unlink(missing_ok=True)
        return True
    if folder.exists():
        shutil.rmtree(folder)  # a conversion interrupted before its note
    try:
        state = handoff_format.read(raw)
    except FileNotFoundError:
        return False
    except Exception:  # not whole, or not this format, or hostile: not a checkpoint
        raw.unlink(missing_ok=True)
        return False
    folder.mkdir()
    tmp = folder / f".{STATE_FILE}.part"
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            size = fh.tell()
    except Exception as exc:  # e.g. the scratch disk is full: keep the hand-over file for a later try
        shutil.rmtree(folder, ignore_errors=True)
        full = disk_full(folder.parent, exc)
        raise CheckpointError(f"checkpoint {folder.name} could not be written: "
                              f"{full or f'{type(exc).__name__}: {exc}'}") from None
    os.replace(tmp, folder / STATE_FILE)
    note = folder / f".{PENDING}"
    note.write_text(json.dumps({"step": parse_step(folder.name), "files": {STATE_FILE: {"bytes": size}}}))
    os.replace(note, folder / PENDING)
    raw.unlink()
    return True


def commit(folder: Path) -> dict[str, Any] | None:
    """Make an uncommitted ``step-<N>`` folder durable and write its marker
    (step 2 above); returns the marker, or None when ``folder`` is not a
    whole written checkpoint (no ``PENDING`` note, or files whose size
    differs from it: such a folder is removed)."""
    if (folder / MARKER).is_file():
        return verify(folder)
    try:
        pending = json.loads((folder / PENDING).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # unreadable note: not a whole checkpoint
        shutil.rmtree(folder, ignore_errors=True)
        return None
    files = {}
    _, refused = regular_files(folder, skip=(MARKER, PENDING))
    if refused:
        raise CheckpointError(f"checkpoint {folder.name} refused: " + "; ".join(refused))
    for name, meta in pending["files"].items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != meta["bytes"]:
            shutil.rmtree(folder, ignore_errors=True)
            return None
        fsync_path(path)
        files[name] = {"bytes": meta["bytes"], "sha256": sha256_file(path)}
    fsync_path(folder)
    fsync_path(folder.parent)
    return write_marker(folder, pending["step"], files, pending.get("sharded"))


def commit_pending(root: Path, newest_only: bool = False, problems: list[str] | None = None) -> list[int]:
    """Commit the written-but-uncommitted checkpoints under ``root`` (noted
    folders, and hand-over files converted first); returns the committed
    steps.  ``newest_only``: commit only the newest and delete the older
    uncommitted ones (only the newest is needed to resume, and each commit's
    fsync slows the work's own writes).  Never raises for one checkpoint:
    a checkpoint that cannot be committed (disk full: its hand-over file is
    kept for a later try; a refused file: the folder is removed) is skipped
    and its reason appended to ``problems``."""
    pending: dict[int, Path] = {}
    if root.is_dir():
        for child in root.iterdir():
            name = child.name
            if name.endswith(HANDOFF_SUFFIX):
                step = parse_step(name[:-len(HANDOFF_SUFFIX)])
                if step is not None:
                    pending[step] = root / step_dir_name(step)
                continue
            step = parse_step(name)
            if step is not None and (child / PENDING).is_file() and not (child / MARKER).exists():
                pending[step] = child
    steps = sorted(pending)
    if newest_only and len(steps) > 1:
        for step in steps[:-1]:
            handoff_path(pending[step]).unlink(missing_ok=True)
            if not (pending[step] / MARKER).exists():
                shutil.rmtree(pending[step], ignore_errors=True)
        steps = steps[-1:]
    done = []
    for step in steps:
        folder = pending[step]
        try:
            if handoff_path(folder).exists() and not _convert_handoff(folder):
                continue
            if commit(folder) is not None:
                done.append(step)
        except (CheckpointError, OSError) as exc:
            if problems is not None:
                problems.append(str(exc) if isinstance(exc, CheckpointError) else
                                f"checkpoint {folder.name} could not be committed: "
                                f"{disk_full(folder.parent, exc) or f'{type(exc).__name__}: {exc}'}")
            if isinstance(exc, CheckpointError) and "refused" in str(exc):
                shutil.rmtree(folder, ignore_errors=True)
    return done


def discard_torn(root: Path) -> list[str]:
    """Remove folders under ``root`` that a kill left half-written (a
    ``step-<N>`` with neither note nor marker, or a temporary name); returns
    their names.  Call only while no work is writing there."""
    gone = []
    if root.is_dir():
        for child in root.iterdir():
            half = (parse_step(child.name) is not None and not (child / MARKER).exists()
                    and not (child / PENDING).exists() and not handoff_path(child).exists())
            part = child.name.startswith(".step-") and child.name.endswith(".part")  # a hand-over being written
            if half or part or child.name.startswith(".tmp-"):
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
                gone.append(child.name)
    return sorted(gone)


def save_state(root: Path, state: dict[str, Any], step: int) -> LocalCheckpoint:
    """:func:`write_state` then :func:`commit` in this process: a whole,
    durable checkpoint on return.  Raises :class:`CheckpointError` for a state
    that is not tensors and plain values."""
    folder = write_state(root, state, step)
    if commit(folder) is None:
        raise CheckpointError(f"{folder}: checkpoint could not be committed")
    return LocalCheckpoint(folder, int(step))


def verify(folder: Path) -> dict[str, Any] | None:
    """The marker of ``folder`` when it is a whole, committed checkpoint whose
    files all match their recorded sizes and sha256; otherwise None."""
    try:
        text = (folder / MARKER).read_text()
    except OSError:
        return None
    try:
        marker = json.loads(text) if text.strip() else None
    except ValueError:
        marker = None
    files = marker.get("files") if isinstance(marker, dict) else None
    if regular_files(folder, skip=(MARKER, PENDING))[1]:
        return None  # a file that may not leave the job (a link out, a hard link, a device)
    if not isinstance(files, dict) or not files:
        # A command may commit with a marker of its own (empty, or any text): describe its files now.
        try:
            return {"step": parse_step(folder.name), "files": describe_files(folder)}
        except CheckpointError:
            return None  # a file that may not leave the job: not a usable checkpoint
    for name, meta in files.items():
        path = folder / name
        try:
            if path.stat().st_size != meta["bytes"] or sha256_file(path) != meta["sha256"]:
                return None
        except (OSError, KeyError, TypeError):
            return None
    return marker


def committed(root: Path) -> list[LocalCheckpoint]:
    """Every folder under ``root`` named ``step-<N>`` that has a marker, oldest
    first (cheap: hashes are not checked; see :func:`latest_valid`)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = parse_step(child.name)
        if step is not None and (child / MARKER).is_file():
            found.append(LocalCheckpoint(child, step))
    return sorted(found, key=lambda c: c.step)


def missing_shards(marker: dict[str, Any]) -> list[str]:
    """The files of a sharded checkpoint that its folder lacks, from its marker (``[]`` for a checkpoint
    that is not sharded).  The marker of a sharded checkpoint (:mod:`e31.tasks.work.sharded`) holds
    ``"sharded": {"rank", "world_size", "token", "shards"}``, ``shards`` naming every file of the whole
    checkpoint (each rank's ``__<rank>_<n>.distcp`` and ``.metadata``); one rank's folder holds only its own
    part until the whole step is fetched from the checkpoint URL."""
    sharded = marker.get("sharded") if isinstance(marker, dict) else None
    if not isinstance(sharded, dict):
        return []
    files = marker.get("files") or {}
    return [name for name in sharded.get("shards") or [] if name not in files]


def latest_valid(root: Path) -> LocalCheckpoint | None:
    """The newest whole checkpoint under ``root`` whose files verify, or None.
    Torn or tampered checkpoints, and one rank's part of a sharded checkpoint
    (:func:`missing_shards`), are skipped in favour of older ones."""
    for ckpt in reversed(committed(root)):
        marker = verify(ckpt.path)
        if marker is not None and not missing_shards(marker):
            return ckpt
    return None
