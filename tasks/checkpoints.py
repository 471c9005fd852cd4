"""The on-disk checkpoint format shared by the work (child process) and the
supervisor.

A checkpoint is a folder ``step-<N>/`` holding one or more files and, written
last, a marker file ``COMMITTED`` (JSON: ``{"step": N, "files": {name:
{"bytes": int, "sha256": hex}}}``).  A folder without its marker, or whose
files do not match the marker's hashes, is not a checkpoint and is ignored.

Writes are atomic and split in two so the work pays only for serialising:
1. :func:`write_state` (the work's process): ``torch.save`` into
   ``step-<N>/`` -- or, under a supervisor, the cheaper raw form of
   :mod:`tasks.handoff` -- then a ``PENDING`` note of the files' sizes,
   written only once every byte is.  No fsync and no hashing here.
2. :func:`commit` (the supervisor's process, or inline without one): turn a
   handed-over state into ``state.pt`` with ``torch.save``, check the
   sizes, fsync the files and folders, hash them, then write the
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

from tasks import handoff as handoff_format
from tasks.storage import fsync_path, sha256_file

MARKER = "COMMITTED"
PENDING = "PENDING"
STATE_FILE = "state.pt"
HANDOFF_FILE = "state.handoff"  # an uncommitted state in the raw form of tasks.handoff
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (with the reason and fix)."""


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
    ``folder`` except the marker and the pending note."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name not in (MARKER, PENDING):
            rel = path.relative_to(folder).as_posix()
            out[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return out


def write_marker(folder: Path, step: int, files: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Write the ``COMMITTED`` marker of ``folder`` atomically, with ``files``
    (``{name: {"bytes", "sha256"}}``; hashed from disk when None); returns
    the marker's content."""
    marker = {"step": int(step), "files": files if files is not None else describe_files(folder)}
    tmp = folder / f".{MARKER}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(marker, indent=1, sort_keys=True))
    fsync_path(tmp)
    os.replace(tmp, folder / MARKER)
    fsync_path(folder)
    return marker


def write_state(root: Path, state: dict[str, Any], step: int, handoff: bool = False) -> Path:
    """Write ``state`` as the uncommitted checkpoint folder ``root/step-<N>``
    (step 1 above); returns the folder.

    ``state`` must hold tensors and plain values only (see :func:`snapshot`);
    anything else is refused with :class:`CheckpointError` before a file is
    written.  An existing folder of the same step is replaced.  ``handoff``
    (the work's process under a supervisor): write the state in the raw form
    of :mod:`tasks.handoff` (~3x cheaper for the work), which :func:`commit`
    turns into the ``torch.save`` file; states that form would not keep
    exactly are saved with ``torch.save`` at once.
    """
    snapshot(state, copy=False)  # refuse what weights_only loading could not read
    final = root / step_dir_name(step)
    if final.exists():
        shutil.rmtree(final)
    final.mkdir(parents=True)
    name = _save(final, state, handoff)
    size = (final / name).stat().st_size
    # The note is written only once every byte of the state is: it marks the folder whole.
    note = final / f".{PENDING}"
    note.write_text(json.dumps({"step": int(step), "files": {name: {"bytes": size}}}))
    os.replace(note, final / PENDING)
    return final


def _save(folder: Path, state: Any, handoff: bool) -> str:
    """Write ``state`` into ``folder``; returns the file name used."""
    if handoff:
        with open(folder / HANDOFF_FILE, "wb") as fh:
            try:
                handoff_format.write(fh, state)
                return HANDOFF_FILE
            except handoff_format.NotHandedOver:
                pass
        (folder / HANDOFF_FILE).unlink()
    import torch

    with open(folder / STATE_FILE, "wb") as fh:
        torch.save(state, fh)
    return STATE_FILE


def _convert_handoff(folder: Path, pending: dict[str, Any]) -> dict[str, Any] | None:
    """Turn a folder's handed-over state into ``state.pt`` (``torch.save``,
    fsynced, renamed into place), rewrite the note to name it, then remove
    the raw file; returns the new note, or None when the raw file is not
    whole.  Each step can be interrupted and redone."""
    import torch

    raw = folder / HANDOFF_FILE
    if not raw.is_file() or raw.stat().st_size != pending["files"][HANDOFF_FILE]["bytes"]:
        return None
    try:
        state = handoff_format.read(raw)
    except Exception:  # not whole, or not this format: not a checkpoint
        return None
    tmp = folder / f".{STATE_FILE}.{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
    fsync_path(tmp)
    os.replace(tmp, folder / STATE_FILE)
    note = {"step": pending["step"], "files": {STATE_FILE: {"bytes": (folder / STATE_FILE).stat().st_size}}}
    tmp = folder / f".{PENDING}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(note))
    os.replace(tmp, folder / PENDING)
    raw.unlink()
    return note


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
    if HANDOFF_FILE in pending.get("files", {}):
        pending = _convert_handoff(folder, pending)
        if pending is None:
            shutil.rmtree(folder, ignore_errors=True)
            return None
    files = {}
    for name, meta in pending["files"].items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != meta["bytes"]:
            shutil.rmtree(folder, ignore_errors=True)
            return None
        fsync_path(path)
        files[name] = {"bytes": meta["bytes"], "sha256": sha256_file(path)}
    fsync_path(folder)
    fsync_path(folder.parent)
    return write_marker(folder, pending["step"], files)


def commit_pending(root: Path, newest_only: bool = False) -> list[int]:
    """Commit the written-but-uncommitted checkpoints under ``root``; returns
    the committed steps.  ``newest_only``: commit only the newest and delete
    the older uncommitted ones (only the newest is needed to resume, and each
    commit's fsync slows the work's own writes)."""
    pending = []
    if root.is_dir():
        for child in root.iterdir():
            step = parse_step(child.name)
            if step is not None and (child / PENDING).is_file() and not (child / MARKER).exists():
                pending.append((step, child))
    pending.sort()
    if newest_only and len(pending) > 1:
        for _, stale in pending[:-1]:
            shutil.rmtree(stale, ignore_errors=True)
        pending = pending[-1:]
    return [step for step, child in pending if commit(child) is not None]


def discard_torn(root: Path) -> list[str]:
    """Remove folders under ``root`` that a kill left half-written (a
    ``step-<N>`` with neither note nor marker, or a temporary name); returns
    their names.  Call only while no work is writing there."""
    gone = []
    if root.is_dir():
        for child in root.iterdir():
            half = parse_step(child.name) is not None and not (child / MARKER).exists() and not (child / PENDING).exists()
            if half or child.name.startswith(".tmp-"):
                shutil.rmtree(child, ignore_errors=True)
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


_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def snapshot(state: Any, copy: bool = True, path: str = "state") -> Any:
    """Check that ``state`` holds only what ``torch.load(weights_only=True)``
    reads -- tensors, numbers, strings, bytes, None, ``torch.Size``, dtypes,
    devices, and dicts/lists/tuples/sets of those -- and, with ``copy``,
    return a copy whose tensors are detached CPU clones (safe to write in the
    background while training changes the originals).

    Raises :class:`CheckpointError` naming the first offending entry, e.g.
    ``state['obj']: a Opaque is not a tensor or plain value``.
    """
    import collections

    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True) if copy else state
    if isinstance(state, (*_PLAIN, torch.Size, torch.dtype, torch.device)):
        return state
    if isinstance(state, dict) and type(state) in (dict, collections.OrderedDict):
        items = {}
        for key, value in state.items():
            if not isinstance(key, (*_PLAIN,)):
                raise CheckpointError(f"{path}: key {key!r} is a {type(key).__name__}; use str or int keys")
            items[key] = snapshot(value, copy, f"{path}[{key!r}]")
        return type(state)(items) if copy else state
    if type(state) in (list, tuple, set):
        values = [snapshot(v, copy, f"{path}[{i}]") for i, v in enumerate(state)]
        return type(state)(values) if copy else state
    raise CheckpointError(
        f"{path}: a {type(state).__module__}.{type(state).__qualname__} is not a tensor or plain value, "
        "so torch.load(weights_only=True) could not read it back. Fix: checkpoint tensors and plain values "
        "only (e.g. model.state_dict(), optimizer.state_dict(), numbers, lists, dicts; numpy arrays via "
        "torch.from_numpy), not whole objects."
    )


def load_state(path: Path) -> Any:
    """Load a state file with ``torch.load(weights_only=True)`` (never the
    unsafe unpickler). Raises :class:`CheckpointError` when it cannot."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError or RuntimeError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: {first}") from None


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
    if not isinstance(files, dict) or not files:
        # A command may commit with a marker of its own (empty, or any text): describe its files now.
        return {"step": parse_step(folder.name), "files": describe_files(folder)}
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


def latest_valid(root: Path) -> LocalCheckpoint | None:
    """The newest checkpoint under ``root`` whose files verify, or None.
    Torn or tampered checkpoints are skipped in favour of older ones."""
    for ckpt in reversed(committed(root)):
        if verify(ckpt.path) is not None:
            return ckpt
    return None
