"""Local-disk helpers of the storage layer: hashing, walking an output
folder, fsync and removal."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from e31.errors import E31Error


class VerifyError(E31Error, RuntimeError):
    """A copy does not match what it must hold (size, ETag or sha256): a staged
    input, a published output file or an uploaded checkpoint.  The message
    names the copy (URLs masked) and both values."""


CHUNK = 4 * 1024 * 1024  # bytes read per hashing step


def sha256_file(path: Path) -> str:
    """sha256 hex digest of a local file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def walk_files(root: Path) -> Iterator[Path]:
    """Every regular file under ``root`` in sorted order, skipping temporary
    ``.part-`` files left by interrupted writes."""
    for path in sorted(Path(root).rglob("*")):
        if path.is_file() and ".part-" not in path.name:
            yield path


def fsync_path(path: Path) -> None:
    """Flush a local file, or a folder's entries, to disk (``fsync``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    if path.is_file():
        fsync_path(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)
