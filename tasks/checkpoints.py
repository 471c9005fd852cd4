"""The on-disk checkpoint format shared by the work (child process) and the
supervisor.

A checkpoint is a folder ``step-<N>/`` holding one or more files and, written
last, a marker file ``COMMITTED`` (JSON: ``{"step": N, "files": {name:
{"bytes": int, "sha256": hex}}}``).  A folder without its marker, or whose
files do not match the marker's hashes, is not a checkpoint and is ignored.

Writes are atomic: the files go to a temporary folder, are fsynced, the
folder is renamed to ``step-<N>``, and then the marker is written under a
temporary name, fsynced and renamed.  States are saved with ``torch.save`` and
read back with ``torch.load(weights_only=True)`` only: tensors and plain
values (dicts, lists, numbers, strings).
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

from tasks.storage import sha256_file

MARKER = "COMMITTED"
STATE_FILE = "state.pt"
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def describe_files(folder: Path) -> dict[str, dict[str, Any]]:
    """``{relative name: {"bytes": int, "sha256": hex}}`` for each file in
    ``folder`` except the marker."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MARKER:
            rel = path.relative_to(folder).as_posix()
            out[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return out


def write_marker(folder: Path, step: int) -> dict[str, Any]:
    """Hash the files of ``folder`` and write its ``COMMITTED`` marker
    atomically; returns the marker's content."""
    marker = {"step": int(step), "files": describe_files(folder)}
    tmp = folder / f".{MARKER}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(marker, indent=1, sort_keys=True))
    _fsync_file(tmp)
    os.replace(tmp, folder / MARKER)
    _fsync_dir(folder)
    return marker


def save_state(root: Path, state: dict[str, Any], step: int) -> LocalCheckpoint:
    """Atomically commit ``state`` as the checkpoint for ``step`` under ``root``.

    ``state`` must hold tensors and plain values only; anything that
    ``torch.load(weights_only=True)`` could not read back is refused with
    :class:`CheckpointError` before a file is written.  An existing
    checkpoint of the same step is replaced.
    """
    import torch

    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        target = tmp / STATE_FILE
        torch.save(state, target)
        _fsync_file(target)
        _check_loadable(target)
        final = root / step_dir_name(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        write_marker(final, step)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return LocalCheckpoint(final, int(step))


def _check_loadable(path: Path) -> None:
    try:
        load_state(path)
    except CheckpointError as exc:
        raise CheckpointError(
            f"checkpoint state holds values that torch.load(weights_only=True) cannot read: {exc}. "
            "Fix: checkpoint tensors and plain values only (e.g. model.state_dict(), "
            "optimizer.state_dict(), numbers, lists, dicts), not whole objects."
        ) from None


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
    if not text.strip():
        # A command may commit with an empty marker: describe its files now.
        return {"step": parse_step(folder.name), "files": describe_files(folder)}
    try:
        marker = json.loads(text)
    except ValueError:
        return None
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or not files:
        return None
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
