"""The ``stage`` task: copy one declared input to compute-local disk.

Each input lands in ``<data_dir>/<name>/`` (a file keeps its base name, a
folder its tree).  A record ``<data_dir>/<name>.stage.json`` remembers the
source's identity (a hash of the URL, size, ETag or mtime); when the source is
unchanged and the staged copy is still there, nothing is copied again.  A
declared ``sha256`` is verified after every copy and a mismatch deletes the
copy and fails the stage.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.logging import get_run_logger

from specs import DataInput, mask_url
from tasks import storage


class StageError(RuntimeError):
    """An input could not be staged (missing, unreadable, or wrong sha256)."""


@dataclass(frozen=True)
class Staged:
    """A staged input: local ``path``, ``bytes`` at the source, whether it was
    ``copied`` this time (False: reused from the cache), seconds taken."""

    name: str
    path: str
    bytes: int
    copied: bool
    seconds: float


def _url_key(url: str) -> str:
    # The cache record stores a hash of the URL, never the URL (it may hold credentials).
    return hashlib.sha256(url.encode()).hexdigest()


def stage_input(item: DataInput, data_dir: Path) -> Staged:
    """Stage ``item`` under ``data_dir``; returns :class:`Staged`.

    Raises :class:`StageError` naming the input and its masked URL when the
    source is missing or unreadable or its sha256 differs from the declared one.
    """
    started = time.monotonic()
    shown = mask_url(item.url)
    try:
        ident = storage.fingerprint(item.url)
    except FileNotFoundError:
        raise StageError(f"data '{item.name}': {shown}: not found") from None
    except Exception as exc:
        raise StageError(f"data '{item.name}': {shown}: cannot read ({type(exc).__name__}: {exc})") from None
    if ident["type"] == "directory" and item.sha256:
        raise StageError(f"data '{item.name}': {shown}: sha256 is declared but the URL is a folder; declare sha256 for single files")
    folder = data_dir / item.name
    local = folder if ident["type"] == "directory" else folder / (posixpath.basename(item.url.rstrip("/")) or item.name)
    record_path = data_dir / f"{item.name}.stage.json"
    record = {"url": _url_key(item.url), **ident, "sha256": item.sha256, "path": str(local)}
    if _cached(record_path, record, local):
        return Staged(item.name, str(local), ident["size"], False, time.monotonic() - started)
    record_path.unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        storage.get(item.url, local)
    except Exception as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise StageError(f"data '{item.name}': {shown}: copy failed ({type(exc).__name__}: {exc})") from None
    _verify(item, local, ident, folder)
    record["staged"] = _local_identity(local)
    record_path.write_text(json.dumps(record, indent=1))
    return Staged(item.name, str(local), ident["size"], True, time.monotonic() - started)


def _local_identity(local: Path) -> list:
    """Size and mtime (ns) of every file of the staged copy: a copy changed
    in place since it was staged is not reused."""
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    return [[str(p.relative_to(local.parent)), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def _cached(record_path: Path, record: dict, local: Path) -> bool:
    try:
        saved = json.loads(record_path.read_text())
        staged = saved.pop("staged", None)
        return saved == record and local.exists() and staged == _local_identity(local)
    except (OSError, ValueError):
        return False


def _verify(item: DataInput, local: Path, ident: dict, folder: Path) -> None:
    if ident["type"] == "file":
        size = local.stat().st_size
        if size != ident["size"]:
            shutil.rmtree(folder, ignore_errors=True)
            raise StageError(f"data '{item.name}': {mask_url(item.url)}: staged {size} bytes, source has {ident['size']}")
        if item.sha256:
            got = storage.sha256_file(local)
            if got != item.sha256:
                shutil.rmtree(folder, ignore_errors=True)
                raise StageError(
                    f"data '{item.name}': sha256 mismatch: declared {item.sha256}, staged file has {got}. "
                    "Fix: update data[].sha256 if the input changed on purpose."
                )


@task(name="stage")
def stage_task(item: DataInput, data_dir: str) -> Staged:
    """Prefect task wrapper of :func:`stage_input`; logs what was copied."""
    result = stage_input(item, Path(data_dir))
    verb = "staged" if result.copied else "unchanged, reused"
    get_run_logger().info("%s %s (%d bytes) in %.2f s", verb, item.name, result.bytes, result.seconds)
    return result
