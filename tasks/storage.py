"""All fsspec access of E31 goes through this module.

Inputs, checkpoints and outputs move between "any storage" (local paths,
``file://``, ``s3://``, ``memory://``, ``http(s)://`` ...) through fsspec's
filesystem for the URL's protocol.  Local files on compute-local disk are
written atomically (temporary name, fsync, ``os.replace``).

URLs given to this module may carry credentials; callers show them only via
:func:`specs.mask_url`.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping

import fsspec
from fsspec.core import url_to_fs

from specs import is_credential_key
from tasks import s3session

CHUNK = 4 * 1024 * 1024  # bytes read per hashing step

_OPTIONS: dict[str, dict[str, Any]] = {}  # URL prefix -> resolved storage options (may hold secrets)
_OPTIONS_LOCK = threading.Lock()


_SECRET_VALUES: set[str] = set()  # values read from Secret blocks (scrub masks them wherever they appear)


def use_options(url: str, options: Mapping[str, Any] | None) -> None:
    """Remember fsspec storage options (already resolved, possibly holding
    credentials) for every URL under ``url``; :func:`filesystem` passes them on.

    They live only in this process's memory: never in Prefect parameters,
    logs or files.  The longest matching prefix wins.
    """
    if not options:
        return
    with _OPTIONS_LOCK:
        _OPTIONS[url.rstrip("/")] = dict(options)


def _options_for(url: str) -> dict[str, Any]:
    with _OPTIONS_LOCK:
        best = ""
        for prefix in _OPTIONS:
            if (url == prefix or url.startswith(prefix + "/")) and len(prefix) > len(best):
                best = prefix
        return dict(_OPTIONS[best]) if best else {}


def scrub(text: str) -> str:
    """``text`` with every credential of the registered storage options --
    string values under a credential-looking key (:func:`specs.is_credential_key`)
    and values read from Prefect Secret blocks (:func:`remember_secret`), 6
    characters or longer -- replaced by ``***``, for error messages that may
    quote a client's request.  Endpoints, regions and other plain options
    stay readable."""
    with _OPTIONS_LOCK:
        values = {v for opts in _OPTIONS.values() for v in _credentials(opts) if len(v) >= 6} | _SECRET_VALUES
    for value in sorted(values, key=len, reverse=True):
        text = text.replace(value, "***")
    return text


def remember_secret(value: Any) -> None:
    """Have :func:`scrub` mask every string in ``value`` (a Secret block's
    value, whatever key it is used under), 6 characters or longer."""
    with _OPTIONS_LOCK:
        _SECRET_VALUES.update(v for v in _strings(value) if len(v) >= 6)


def _credentials(options: Mapping[str, Any], under: bool = False) -> Iterator[str]:
    for key, value in options.items():
        secret = under or is_credential_key(key)
        if isinstance(value, Mapping):
            yield from _credentials(value, secret)
        elif secret:
            yield from _strings(value)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(filesystem, path)`` for an fsspec URL or local path, with the
    storage options registered by :func:`use_options` for it.

    Raises whatever fsspec raises for an unknown protocol (``ValueError``)
    or a missing optional backend (``ImportError``).  An s3fs filesystem
    gets a session that reads timestamps quickly (:mod:`tasks.s3session`).
    """
    fs, path = url_to_fs(url, **_options_for(url))
    s3session.prepare(fs)
    return fs, path


def join(url: str, *parts: str) -> str:
    """Join POSIX path parts onto ``url`` keeping its protocol, e.g.
    ``join("s3://b/out/", "model.pt") == "s3://b/out/model.pt"``."""
    base = url.rstrip("/")
    return "/".join([base, *[p.strip("/") for p in parts if p]])


def is_local(url: str) -> bool:
    """True when ``url`` names the local filesystem (a path or ``file://``)."""
    fs, _ = filesystem(url)
    return "file" in protocols(fs)


def backend_problem(url: str) -> str | None:
    """Why no fsspec filesystem can serve ``url`` here (``Protocol not known:
    s4``, ``Please install gcsfs ...``), or None when its backend loads.
    Checks the protocol only: nothing is contacted, no credential is needed."""
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as exc:
        return str(exc)
    return None


def protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    """The protocol names of ``fs`` (e.g. ``("s3", "s3a")``)."""
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


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


class PublishVerifyError(RuntimeError):
    """An uploaded object does not match the local file (size, ETag or sha256)."""


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
    (:mod:`tasks.etag`); otherwise the object is read back and its sha256
    compared.  Raises :class:`PublishVerifyError` (the bad object is removed)
    or what the filesystem raises.  ``sha256`` skips hashing the local file
    when the caller knows it.
    """
    from tasks import etag  # local import: etag is a leaf module

    local_path = Path(local_path)
    size = local_path.stat().st_size
    digest = sha256 or sha256_file(local_path)
    fs, path = filesystem(url)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    kwargs = {"callback": callback} if callback is not None else {}
    if "file" in protocols(fs):
        tmp = f"{path}.part-{uuid.uuid4().hex[:8]}"
        try:
            shutil.copyfile(local_path, tmp)
            _fsync(Path(tmp))
            if os.stat(tmp).st_size != size:
                raise PublishVerifyError(f"{tmp}: {os.stat(tmp).st_size} bytes written, {size} expected")
            os.replace(tmp, path)
        finally:
            _remove(Path(tmp))
        if callback is not None:
            callback.relative_update(size)
        return size, digest
    target = path if _atomic(fs) else f"{path}.e31-part-{uuid.uuid4().hex[:8]}"
    try:
        fs.put_file(str(local_path), target, **kwargs)
        _verify_remote(fs, target, local_path, size, digest, etag)
        if target != path:
            fs.mv(target, path)
    except BaseException:
        try:
            fs.rm_file(target)
        except Exception:
            pass
        raise
    return size, digest


def _verify_remote(fs: fsspec.AbstractFileSystem, path: str, local_path: Path, size: int, digest: str, etag) -> None:
    fs.invalidate_cache(path)
    info = fs.info(path)
    got = int(info.get("size") or 0)
    if got != size:
        raise PublishVerifyError(f"uploaded object has {got} bytes, the local file {size}")
    tag = info.get("ETag") or info.get("etag")
    same = etag.matches(local_path, str(tag) if tag else None, size)
    if same is False:
        raise PublishVerifyError(f"uploaded object's ETag {tag} is not the local file's MD5")
    if same is None:  # no content hash from the store: read it back
        back = hashlib.sha256()
        with fs.open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(CHUNK), b""):
                back.update(chunk)
        if back.hexdigest() != digest:
            raise PublishVerifyError(f"read back sha256 {back.hexdigest()}, the local file has {digest}")


def put_file(local_path: Path, url: str) -> None:
    """Upload one local file to ``url`` (parents created) with
    :func:`publish_file`: whole or not at all, and verified."""
    publish_file(local_path, url)


def write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` to ``url`` whole: local files through a temporary file,
    fsync and rename; atomic stores in one PUT; other stores through a
    temporary key and a move."""
    fs, path = filesystem(url)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if "file" in protocols(fs):
        tmp = Path(f"{path}.part-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        finally:
            _remove(tmp)
    elif _atomic(fs):
        fs.pipe_file(path, data)
    else:
        tmp = f"{path}.e31-part-{uuid.uuid4().hex[:8]}"
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)


def read_bytes(url: str) -> bytes:
    """Read the whole object at ``url``; ``FileNotFoundError`` when absent."""
    fs, path = filesystem(url)
    return fs.cat_file(path)


def exists(url: str) -> bool:
    """True when an object or folder is at ``url``."""
    fs, path = filesystem(url)
    return fs.exists(path)


def list_dirs(url: str) -> list[str]:
    """Names of the immediate sub-folders of ``url`` ([] when it does not exist)."""
    fs, path = filesystem(url)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    return sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory")


def remove(url: str) -> None:
    """Delete the file or folder at ``url`` (recursively); absent is fine."""
    fs, path = filesystem(url)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


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
