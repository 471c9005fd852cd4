"""fsspec filesystems for E31's URLs: the per-URL storage options registry,
``filesystem(url)`` and the small verbs built on it (join, exists, list,
read, remove).

URLs given here may carry credentials; callers show them only through
:func:`e31.specs.mask_url`.  Options registered with :func:`use_options`
(possibly holding resolved secrets) live only in this process's memory.
"""

from __future__ import annotations

import posixpath
import threading
from typing import Any, Mapping

import fsspec
from fsspec.core import url_to_fs

from e31.specs.urls import file_url_path, quote_for_file_url
from e31.tasks.storage import s3session

_OPTIONS: dict[str, dict[str, Any]] = {}  # URL prefix -> resolved storage options (may hold secrets)
_OPTIONS_LOCK = threading.Lock()


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


def registered_options() -> list[dict[str, Any]]:
    """Copies of every registered storage options mapping (for masking)."""
    with _OPTIONS_LOCK:
        return [dict(o) for o in _OPTIONS.values()]


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(filesystem, path)`` for an fsspec URL or local path, with the
    storage options registered by :func:`use_options` for it.

    A ``file://`` URL's path is percent-decoded (RFC 8089, :func:`e31.specs.urls.file_url_path`):
    ``file:///data/my%20data.csv`` is the file ``/data/my data.csv``; fsspec
    itself would look for ``my%20data.csv``.  A plain path is taken as written.

    Raises whatever fsspec raises for an unknown protocol (``ValueError``)
    or a missing optional backend (``ImportError``).  An s3fs filesystem
    gets a session that reads timestamps quickly (:mod:`e31.tasks.storage.s3session`).
    """
    options = _options_for(url)
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    parts = url.split("::")
    local = file_url_path(parts[-1])
    if local is not None and len(parts) == 1:  # built here: a decoded "::" or "file://" is part of the name
        fs = fsspec.filesystem("file", **with_timeouts("file", options))
        return fs, fs._strip_protocol(local)
    if local is not None and "::" not in local:  # a chain (simplecache::file://...) ending in a local file
        url = "::".join([*parts[:-1], local])
    fs, path = url_to_fs(url, **with_timeouts(protocol, options))
    s3session.prepare(fs)
    if protocol in ("s3", "s3a") and getattr(fs, "retries", 0) > S3FS_RETRIES:
        fs.retries = S3FS_RETRIES  # s3fs's own retry loop around botocore's (default 5)
    return fs, path


#: s3fs's own attempts per call (each under botocore's own attempts).
S3FS_RETRIES = 2


def with_timeouts(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with E31's default time bounds for the store's client,
    so no call waits forever on a store that stopped answering (a frozen
    server accepts connections and then says nothing):

    * ``s3``: botocore's ``connect_timeout`` and ``read_timeout`` (seconds
      without a byte, per request; ``E31_STORE_CONNECT_TIMEOUT_S``, default
      10, and ``E31_STORE_READ_TIMEOUT_S``, default 60) and 2 attempts;
    * ``http``/``https``: aiohttp's ``sock_connect`` and ``sock_read`` timeouts.

    What the user gave in ``config_kwargs`` / ``client_kwargs`` wins."""
    from e31.tasks import settings

    connect = settings.value("E31_STORE_CONNECT_TIMEOUT_S")
    read = settings.value("E31_STORE_READ_TIMEOUT_S")
    options = dict(options)
    if protocol in ("s3", "s3a"):
        given = dict(options.get("config_kwargs") or {})
        options["config_kwargs"] = {"connect_timeout": connect, "read_timeout": read,
                                    "retries": {"max_attempts": 2, "mode": "standard"}, **given}
    elif protocol in ("http", "https"):
        import aiohttp

        given = dict(options.get("client_kwargs") or {})
        given.setdefault("timeout", aiohttp.ClientTimeout(total=None, connect=connect, sock_connect=connect,
                                                          sock_read=read))
        options["client_kwargs"] = given
    return options


def join(url: str, *parts: str) -> str:
    """Join POSIX path parts onto ``url`` keeping its protocol, e.g.
    ``join("s3://b/out/", "model.pt") == "s3://b/out/model.pt"``.  The parts
    are names as they are on disk: onto a ``file://`` URL (whose path is
    percent-decoded) a ``%`` in them is written ``%25``, so
    ``join("file:///r%20d/", "100%.txt")`` names ``/r d/100%.txt``."""
    base = url.rstrip("/")
    quote = quote_for_file_url if file_url_path(url.split("::")[-1]) is not None else str
    return "/".join([base, *[quote(p.strip("/")) for p in parts if p]])


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
    """Delete the folder at ``url`` with everything in it, or the one file
    there; absent is fine.  The name is taken literally: fsspec's ``rm``
    expands glob characters (``*``, ``[1]``) on some stores, so a file is
    removed with ``rm_file`` and a folder's files are listed and removed
    one by one."""
    fs, path = filesystem(url)
    try:
        if not fs.isdir(path):
            fs.rm_file(path)
            return
        for name in sorted(fs.find(path), reverse=True):
            fs.rm_file(name)
        if "file" in protocols(fs):  # the emptied folders too (an object store has none)
            import shutil

            shutil.rmtree(path, ignore_errors=True)
    except FileNotFoundError:
        pass


def remove_file(url: str) -> None:
    """Delete the one object or file at ``url`` (its name taken literally);
    absent is fine."""
    fs, path = filesystem(url)
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass
