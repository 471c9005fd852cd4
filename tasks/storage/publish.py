"""Move whole files between local disk and any fsspec URL: ``get`` (a file
or folder down, under a temporary name then renamed) and ``publish_file`` /
``write_bytes`` (up, so the destination only ever names a whole object),
each verified."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import time
import posixpath
import shutil
import uuid
from pathlib import Path
from typing import Any

import fsspec

from e31.tasks.storage.filesystems import filesystem, protocols
from e31.tasks.storage.local import CHUNK, VerifyError, _fsync, _remove, sha256_file


def get(url: str, local_path: Path) -> Path:
    """Copy the file or folder at ``url`` to ``local_path`` (compute-local).

    A file lands at exactly ``local_path``; a folder's contents land inside
    ``local_path`` (never nested a second time).  The copy is made under a
    temporary sibling name and renamed into place, so a failed transfer
    leaves nothing that looks complete.  Returns ``local_path``.
    """
    fs, path = filesystem(url)
    local_path = Path(local_path)
    local_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = local_path.with_name(f".{local_path.name}.part-{uuid.uuid4().hex[:8]}")
    try:
        if fs.isdir(path):
            fs.get(path.rstrip("/") + "/", str(tmp) + "/", recursive=True)
        else:
            fs.get_file(path, str(tmp))
            _fsync(tmp)
        _remove(local_path)
        os.replace(tmp, local_path)
    finally:
        _remove(tmp)
    return local_path


#: Protocols whose stores publish an object only when its upload is whole
#: (a single PUT, or a completed multipart/resumable/block-list upload).
ATOMIC_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "memory"})


def _atomic(fs: fsspec.AbstractFileSystem) -> bool:
    return bool(ATOMIC_PROTOCOLS.intersection(protocols(fs)))


def publish_file(local_path: Path, url: str, *, sha256: str | None = None, callback: Any = None) -> tuple[int, str]:
    """Upload one local file so that ``url`` only ever names the whole file,
    verify it there, and return ``(bytes, sha256 hex)`` of the local file.

    * local destinations: a temporary sibling name, fsync, ``os.replace``;
    * stores in :data:`ATOMIC_PROTOCOLS`: one ``put_file`` (S3 publishes an
      object only when its PUT or multipart upload completes; s3fs aborts a
      failed multipart upload);
    * any other store: a temporary key ``<url>.e31-part-<id>``, then a move.

    Verification: the size always; on stores with MD5-form ETags the ETag
    (:mod:`e31.tasks.storage.etag`); otherwise the object is read back and its sha256
    compared.  Raises :class:`VerifyError` or what the filesystem raises.
    A failed or cut upload never removes what was at ``url`` before: only
    E31's own temporary name (``*.e31-part-<hex>``) is removed.  ``sha256``
    skips hashing the local file when the caller knows it.
    """
    from e31.tasks.storage import etag  # local import: etag is a leaf module

    local_path = Path(local_path)
    size = local_path.stat().st_size
    digest = sha256 or sha256_file(local_path)
    fs, path = filesystem(url)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if "file" in protocols(fs):
        tmp = temporary_name(path)
        try:
            shutil.copyfile(local_path, tmp)
            _fsync(Path(tmp))
            if os.stat(tmp).st_size != size:
                raise VerifyError(f"{tmp}: {os.stat(tmp).st_size} bytes written, {size} expected")
            os.replace(tmp, path)
            _fsync_dir(Path(path).parent)
        finally:
            _remove(Path(tmp))
        if callback is not None:
            callback.relative_update(size)
        return size, digest
    target = path if _atomic(fs) else temporary_name(path)
    try:
        put_bounded(fs, str(local_path), target, size, callback)
        _verify_remote(fs, target, local_path, size, digest, etag)
        if target != path:
            fs.mv(target, path)
    except BaseException:
        if target != path:  # never the final key: what was there before stays
            try:
                fs.rm_file(target)
            except Exception:
                pass
        raise
    return size, digest


#: Slowest upload rate (bytes/s) a store is given before a transfer counts as stalled.
MIN_RATE = 1024**2
#: Bytes s3fs sends between two progress reports at most (its multipart part size).
UNIT = 50 * 1024**2


class _Watched:
    """An fsspec callback that notes when the transfer last moved (and
    passes everything on to ``inner``)."""

    def __init__(self, inner: Any):
        self.inner, self.last = inner, time.monotonic()

    def set_size(self, size):
        self.last = time.monotonic()
        if self.inner is not None:
            self.inner.set_size(size)

    def relative_update(self, inc=1):
        self.last = time.monotonic()
        if self.inner is not None:
            self.inner.relative_update(inc)

    def branched(self, *args, **kwargs):
        return None

    def call(self, *args, **kwargs):
        pass


def put_bounded(fs: fsspec.AbstractFileSystem, lpath: str, rpath: str, size: int, callback: Any = None) -> None:
    """``fs.put_file(lpath, rpath)`` that cannot hang: on an async store
    (s3fs, gcsfs, adlfs ...) the upload is cancelled once it has made no
    progress for ``E31_STORE_READ_TIMEOUT_S`` plus the time the next unit
    of at most :data:`UNIT` bytes takes at :data:`MIN_RATE` (a server that
    stops reading leaves the client's write blocked with no timeout of its
    own).  Raises ``TimeoutError`` saying so."""
    import asyncio

    from fsspec.asyn import AsyncFileSystem

    if not isinstance(fs, AsyncFileSystem):
        fs.put_file(lpath, rpath, **({"callback": callback} if callback is not None else {}))
        return
    from e31.tasks import settings

    watched = _Watched(callback)
    gap = settings.value("E31_STORE_READ_TIMEOUT_S") + min(size, UNIT) / MIN_RATE
    future = asyncio.run_coroutine_threadsafe(fs._put_file(lpath, rpath, callback=watched), fs.loop)
    while True:
        try:
            future.result(timeout=0.5)
            return
        except concurrent.futures.TimeoutError:
            if time.monotonic() - watched.last > gap:
                future.cancel()
                raise TimeoutError(f"the upload made no progress for {gap:.0f} s; the store stopped answering") \
                    from None


def temporary_name(path: str) -> str:
    """The temporary sibling a write to ``path`` goes through:
    ``.e31-part-<8 hex>`` in the same folder (a fixed, short name: a file
    whose own name is near the 255-byte limit still has room).  A return
    removes leftovers of this form (:class:`e31.tasks.destination.Destination`)."""
    return posixpath.join(posixpath.dirname(path), f".e31-part-{uuid.uuid4().hex[:8]}")


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _verify_remote(fs: fsspec.AbstractFileSystem, path: str, local_path: Path, size: int, digest: str, etag) -> None:
    fs.invalidate_cache(path)
    info = fs.info(path)
    got = int(info.get("size") or 0)
    if got != size:
        raise VerifyError(f"uploaded object has {got} bytes, the local file {size}")
    tag = info.get("ETag") or info.get("etag")
    same = etag.matches(local_path, str(tag) if tag else None, size)
    if same is False:
        raise VerifyError(f"uploaded object's ETag {tag} is not the local file's MD5")
    if same is None:  # no content hash from the store: read it back
        back = hashlib.sha256()
        with fs.open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(CHUNK), b""):
                back.update(chunk)
        if back.hexdigest() != digest:
            raise VerifyError(f"read back sha256 {back.hexdigest()}, the local file has {digest}")


def write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` to ``url`` whole: local files through a temporary file,
    fsync and rename; atomic stores in one PUT; other stores through a
    temporary key and a move."""
    fs, path = filesystem(url)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if "file" in protocols(fs):
        tmp = Path(temporary_name(path))
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            _fsync_dir(Path(path).parent)
        finally:
            _remove(tmp)
    elif _atomic(fs):
        fs.pipe_file(path, data)
    else:
        tmp = temporary_name(path)
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
