"""Listing what an input URL names, before anything is copied.

A single file, a folder (recursively; empty sub-folders recorded) or a glob,
on any fsspec filesystem (through :func:`e31.tasks.storage.filesystem`, which
adds the URL's storage options).  The listing's digest is the staging
cache key; a second listing after a copy shows whether the source changed.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
import subprocess
from dataclasses import dataclass, field
from glob import has_magic
from typing import Any, NamedTuple

import fsspec

from e31.tasks.storage.filesystems import filesystem, protocols


class OnlyFolders(FileNotFoundError):
    """A glob matched folders only (staging copies the files a glob matches)."""


#: ``Entry.size`` of a source whose size its store does not say (an HTTP body sent chunked or
#: compressed): staged by streaming, its size known only once copied.
UNKNOWN_SIZE = -1


class Entry(NamedTuple):
    """One source file of an input: ``rel`` its POSIX path under the input's
    root, ``path`` its path on the filesystem, ``size`` in bytes
    (:data:`UNKNOWN_SIZE` when the store does not say), ``version`` (ETag,
    else modification time) and ``etag`` (None when the store has none)."""

    rel: str
    path: str
    size: int
    version: str
    etag: str | None = None


@dataclass
class Listing:
    """What one input URL names, listed before anything is copied.

    ``url`` may hold credentials: show it only through ``e31.specs.mask_url``.
    ``kind`` is ``file``, ``folder`` or ``glob``; ``entries`` the files
    (sorted by ``rel``); ``dirs`` the sub-folders with no files (kept when
    staged); ``local`` whether the source is on this machine's filesystem.
    """

    url: str
    kind: str
    entries: list[Entry]
    dirs: list[str] = field(default_factory=list)
    local: bool = False
    root: str = ""  # the folder's (or the glob base's) path on its filesystem
    #: sha256 of the raw scan (:func:`find_output`) a local folder was listed
    #: from, "" otherwise: an equal scan later means an unchanged folder.
    scan: str = ""

    @property
    def bytes(self) -> int:
        """Total size of the files, in bytes (those of unknown size count 0)."""
        return sum(max(e.size, 0) for e in self.entries)

    @property
    def files(self) -> int:
        """How many files the input holds."""
        return len(self.entries)

    @property
    def size_unknown(self) -> bool:
        """Whether the store does not say the size of some file."""
        return any(e.size == UNKNOWN_SIZE for e in self.entries)

    def digest(self) -> str:
        """sha256 over every ``(rel, size, version)`` and empty folder: equal
        digests mean an unchanged input (the staging cache key)."""
        text = "".join([self.kind, *(f"\n{e.rel}\0{e.size}\0{e.version}" for e in self.entries),
                        *(f"\n{d}/" for d in self.dirs)])
        return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def list_input(url: str) -> Listing:
    """List what ``url`` names: a single file, a folder (recursively; with
    or without a trailing slash, the same tree) or a glob (``*``, ``?``,
    ``[..]``, ``**``; paths relative to the part before the first wildcard).
    A URL that names an existing object is that object, even when its name
    holds glob characters (``data/run[1].csv``); it is a pattern only when
    nothing has that exact name.  Zero-byte "folder marker" objects (keys
    ending in ``/``, as S3 consoles make them) are folders, not files.

    Raises ``FileNotFoundError`` when nothing is there (or a glob matches no
    file), and whatever the filesystem raises when it cannot be read
    (``PermissionError``, ``OSError``, a store's client error).
    """
    fs, path = filesystem(url)
    local = "file" in protocols(fs)
    if not local:
        fs.invalidate_cache()  # a listing must show the store now, not s3fs's cached listing of a moment ago
    if has_magic(path) and not {"http", "https"} & set(protocols(fs)) and not fs.exists(path):  # "?" starts an HTTP query
        base = path[: min(path.find(c) for c in "*?[" if c in path)].rsplit("/", 1)[0]
        found = fs.glob(path, detail=True)
        entries = [_entry(fs, name, _under(name, base), info) for name, info in sorted(found.items())
                   if info.get("type") != "directory" and not _marker(name, info)]
        if not entries:
            folders = sum(1 for info in found.values() if info.get("type") == "directory")
            if folders:
                raise OnlyFolders(f"the pattern matches {folders} folder(s) and no file; stage a folder with its "
                                  "URL (no wildcard), or match files inside (e.g. .../*/**)")
            raise FileNotFoundError(f"no file matches {path}")
        return Listing(url, "glob", entries, local=local, root=base)
    path = path.rstrip("/") or path
    info = fs.info(path)
    if info.get("type") != "directory":
        name = posixpath.basename(path.split("?", 1)[0].split("#", 1)[0]) if not local else posixpath.basename(path)
        return Listing(url, "file", [_entry(fs, path, name or "data", info)], local=local)  # no query (a signature) in names
    scan = ""
    if local:
        raw = find_output(path)
        scan = hashlib.sha256(raw).hexdigest() if raw is not None else ""
        entries, dirs = _walk_local(path, raw)
    else:
        found = fs.find(path, withdirs=True, detail=True)
        entries, folders = [], []
        for name, meta in sorted(found.items()):
            stripped = fs._strip_protocol(name) if "://" in name else name  # s3fs, gcsfs... give bare paths
            rel = _under(stripped, path)
            if rel in (".", ""):
                continue
            if meta.get("type") == "directory" or _marker(name, meta):
                folders.append(rel.rstrip("/"))
            else:
                entries.append(_entry(fs, stripped, rel, meta))
        dirs = _empty_dirs(sorted(set(folders) - {""}), [e.rel for e in entries])  # a marker and its prefix: one
    return Listing(url, "folder", entries, dirs, local=local, root=path, scan=scan)


def _marker(name: str, info: dict[str, Any]) -> bool:
    """A zero-byte "folder marker" object: a key ending in ``/``."""
    return name.endswith("/") and not info.get("size")


def unchanged(listing: Listing) -> bool:
    """True when a local folder listed by GNU find scans now exactly as it
    did (every name, type, size and mtime, in the same order): no need to
    list it again.  False when it differs, cannot be scanned, or was not
    listed that way (then list it again and compare)."""
    if not listing.scan:
        return False
    try:
        raw = find_output(listing.root)
    except OSError:
        return False
    return raw is not None and hashlib.sha256(raw).hexdigest() == listing.scan


def _walk_local(root: str, raw: bytes | None = None) -> tuple[list[Entry], list[str]]:
    """List a local folder (symbolic links followed, as staging copies what
    they point to): files sorted by ``rel`` and the empty leaf folders
    (``raw``: its :func:`find_output`, when already taken)."""
    files, folders = scan_local(root, raw)
    entries = [Entry(rel, f"{root}/{rel}", size, version) for rel, (size, version) in sorted(files.items())]
    return entries, _empty_dirs(folders, files)


#: The ``-printf`` format of :func:`find_output`: type, size, ``mtime:inode:ctime`` and path.
FULL_FORMAT = "%y %s %T@:%i:%C@ %P\\0"
#: A cheaper format that still changes with any change below the root: ``ctime:inode`` and path (every
#: change to a file -- content, size, mtime set back, mode, a rename -- moves its ctime, which no process
#: can set back; a new file is a new inode and name; an added or removed name moves its folder's ctime).
#: GNU find spends most of a scan formatting: this takes less than :data:`FULL_FORMAT`.
CHANGE_FORMAT = "%C@:%i %P\\0"


def change_hash(root: str) -> str | None:
    """sha256 of a :data:`CHANGE_FORMAT` scan of the local folder ``root``
    (None without GNU find): equal hashes mean nothing below ``root``
    changed in between.  Raises ``OSError`` as :func:`find_output`."""
    raw = find_output(root, CHANGE_FORMAT)
    return hashlib.sha256(raw).hexdigest() if raw is not None else None


def find_output(root: str, fmt: str = FULL_FORMAT) -> bytes | None:
    """The raw output of one GNU ``find -L ROOT -mindepth 1 -printf``
    pass over the local folder ``root``: for each entry below it, its type,
    size in bytes, ``mtime:inode:ctime`` and path relative to ``root``,
    NUL-terminated, in directory order (``fmt``: another ``-printf``
    format).  None when GNU find is not available.  Raises
    ``OSError`` naming the first path that cannot be read.

    (C; 10,000 files in ~0.02 s on 2 cores, 3-4x faster than ``os.scandir``
    plus a stat per file in Python.)
    """
    if not _GNU_FIND:
        return None
    done = subprocess.run([_GNU_FIND, "-L", root, "-mindepth", "1", "-printf", fmt],
                          capture_output=True)
    if done.returncode != 0:
        problem = os.fsdecode(done.stderr).strip().splitlines()
        raise OSError(problem[0] if problem else f"find failed with exit code {done.returncode}")
    return done.stdout


def scan_local(root: str, raw: bytes | None = None) -> tuple[dict[str, tuple[int, str]], list[str]]:
    """Every file under the local folder ``root`` as ``{rel: (size in bytes,
    mtime)}`` and every sub-folder, symbolic links followed: parsed from
    ``raw`` (its :func:`find_output`) or from a new scan, else by
    ``os.scandir`` where there is no GNU find.

    The "mtime" is a string of the mtime, inode and ctime whose form
    depends on the scanner: compare only values from this function.  Raises ``OSError`` naming the first path
    that cannot be read or a broken symbolic link.
    """
    if raw is None:
        raw = find_output(root)
    if raw is None:
        return _scandir(root)
    files: dict[str, tuple[int, str]] = {}
    folders: list[str] = []
    for item in os.fsdecode(raw).split("\0")[:-1]:
        kind, size, mtime, rel = item.split(" ", 3)
        if kind == "d":
            folders.append(rel)
        elif kind == "l":
            raise OSError(f"{rel}: broken symbolic link")
        else:
            files[rel] = (int(size), mtime)
    return files, folders


def _scandir(root: str) -> tuple[dict[str, tuple[int, str]], list[str]]:
    files: dict[str, tuple[int, str]] = {}
    folders: list[str] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel)) as it:
            for item in it:
                sub = f"{rel}/{item.name}" if rel else item.name
                if item.is_dir():
                    folders.append(sub)
                    stack.append(sub)
                else:
                    try:
                        st = item.stat()
                    except FileNotFoundError:
                        raise OSError(f"{sub}: broken symbolic link") from None
                    files[sub] = (st.st_size, f"{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}")
    return files, folders


def _gnu_find() -> str | None:
    found = shutil.which("find")
    if not found:
        return None
    try:
        probe = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return found if "GNU findutils" in probe.stdout else None


_GNU_FIND = _gnu_find()


def _empty_dirs(folders: list[str], files) -> list[str]:
    """The leaf folders with no file anywhere below them (``files``: the
    files' relative paths)."""
    parents = {rel.rpartition("/")[0] for rel in files}
    full = set()
    for p in parents:
        while p and p not in full:
            full.add(p)
            p = p.rpartition("/")[0]
    empty = [d for d in folders if d not in full]
    return sorted(d for d in empty if not any(o.startswith(d + "/") for o in empty))  # leaves only


def _under(name: str, root: str) -> str:
    """``name`` relative to the folder ``root`` (both bare paths, POSIX):
    a prefix cut when ``name`` is below ``root`` (10,000 names: ~5 ms against
    ~0.3 s for ``posixpath.relpath``), else ``posixpath.relpath``."""
    prefix = root.rstrip("/") + "/"
    if name.startswith(prefix) and "/." not in name[len(prefix) - 1:] and "//" not in name:
        return name[len(prefix):]
    return posixpath.relpath(name, root)


def _entry(fs: fsspec.AbstractFileSystem, path: str, rel: str, info: dict[str, Any]) -> Entry:
    etag = info.get("ETag") or info.get("etag")
    size = info.get("size")
    return Entry(rel, path if "://" not in path else fs._strip_protocol(path),
                 int(size) if size is not None else UNKNOWN_SIZE,
                 _version(info), str(etag).strip('"') if etag else None)



def _version(info: dict[str, Any]) -> str:
    """ETag when the store has one, else the modification time, as a string;
    for a local file (fsspec's local ``info`` has ``ino``), ``mtime:inode:ctime``
    (a file rewritten with its size and mtime put back has another ctime)."""
    if info.get("ino") is not None and info.get("mtime") is not None:
        return f"{info['mtime']}:{info['ino']}:{info.get('created')}"
    for key in ("ETag", "etag", "md5", "mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            return str(info[key]).strip('"')
    return ""
