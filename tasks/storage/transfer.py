"""Copy a listed input to compute-local disk, in parallel, and verify it.

* Local folders are copied by GNU ``cp -R`` (the fastest copier on this
  kind of machine: fsspec's local recursive copy is ~3x slower on 10,000
  small files); local single files by ``sendfile`` in 8 MiB steps (progress
  between steps).
* Async stores (s3, gs, az, http) get every file of a list in one fsspec
  ``get`` with ``batch_size`` concurrent transfers; other stores use a
  thread pool of ``get_file`` calls.
* :func:`verify` checks each copy's size, and its MD5 against the store's
  ETag where the ETag is one (see :mod:`e31.tasks.storage.etag`).

Everything is written under a destination folder the caller renames into
place only when the copy is whole.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fsspec.asyn import AsyncFileSystem
from fsspec.callbacks import Callback

from e31.tasks.storage import etag, s3session

from e31.tasks import settings, storage
from e31.tasks.storage.local import VerifyError
from e31.tasks.storage.listing import UNKNOWN_SIZE, Entry, Listing, find_output, scan_local
from e31.tasks.storage.progress import TransferProgress

BATCH_SIZE = settings.value("E31_TRANSFER_BATCH")  # concurrent file transfers from a store
THREADS = 8  # get_file threads for stores without an async client
STEP = 8 * 2**20  # bytes per sendfile call on local copies (a prefetch's rate cap acts between them)
#: Single objects at least this big (bytes) are hashed while they download.
FOLLOW_BYTES = 16 * 2**20
#: Concurrent ranged GETs per large object on S3 (s3fs ``max_concurrency``).
#: Each stream costs client CPU: on 2 cores one stream measured faster than
#: s3fs's 10 (1 GiB from a local server: 2.1-4.3 s against 6.6-8.2 s), so the
#: default (:mod:`e31.tasks.settings`) is half the usable cores, between 1 and 10.
STREAMS_PER_FILE = settings.value("E31_STREAMS_PER_FILE")


class ChangedWhileCopying(RuntimeError):
    """A source file changed (size, ETag or mtime) between the listing and
    the end of its copy; ``files`` names them (relative paths)."""

    def __init__(self, files: list[str]):
        super().__init__(f"{len(files)} file(s) changed while being copied: {', '.join(files[:5])}")
        self.files = files


def fetch(listing: Listing, dest: Path, progress: TransferProgress) -> dict[str, bool | None]:
    """Copy every entry of ``listing`` to ``dest / entry.rel`` and create its
    empty folders.  ``dest`` must not exist (it is created).  Returns the
    ETag checks already made while downloading (``{rel: True/False/None}``,
    see :class:`e31.tasks.storage.etag.Follower`) for :func:`verify`.  Raises what the
    filesystem raises; the caller removes ``dest`` on failure."""
    checked: dict[str, bool | None] = {}
    dest = Path(dest)
    if listing.local and listing.kind == "folder" and listing.entries and shutil.which("cp"):
        _cp_tree(listing.root, dest, progress)
        progress.advance(listing.bytes)
    else:
        dest.mkdir(parents=True, exist_ok=False)
        for parent in sorted({str(Path(e.rel).parent) for e in listing.entries} - {"."}):
            (dest / parent).mkdir(parents=True, exist_ok=True)
        if listing.local:
            for e in listing.entries:
                _copy_local(e, dest / e.rel, progress)
        else:
            checked = _get_remote(listing, dest, progress)
    for d in listing.dirs:
        (dest / d).mkdir(parents=True, exist_ok=True)
    return checked


def _cp_tree(root: str, dest: Path, progress: TransferProgress) -> None:
    """``cp`` the folder ``root`` to ``dest``; every 0.2 s ``progress`` is
    asked whether to go on (``advance(0)`` raises once it is stopped: cp is
    then killed).  Raises ``OSError`` with cp's message when it fails."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # -R recursive, -L follow symlinks (stage the data, not links back to the source), -T dest is the copy itself
    with subprocess.Popen(["cp", "-RLT", "--", root, str(dest)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            while True:
                try:
                    _, stderr = proc.communicate(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    progress.advance(0)
        except BaseException:
            proc.kill()
            raise
    if proc.returncode != 0:
        raise OSError(f"cp failed: {stderr.strip()[-500:]}")


def _copy_local(entry: Entry, target: Path, progress: TransferProgress) -> None:
    with open(entry.path, "rb") as src, open(target, "wb") as dst:
        offset = 0
        while True:
            sent = os.sendfile(dst.fileno(), src.fileno(), offset, STEP)
            if sent == 0:
                break
            offset += sent
            progress.advance(sent)


def _get_remote(listing: Listing, dest: Path, progress: TransferProgress) -> dict[str, bool | None]:
    """Download the listing's files; on S3 every read is pinned to the
    version listed (``If-Match`` its ETag): an object replaced meanwhile
    raises :class:`ChangedWhileCopying` instead of being staged as a splice
    of two versions."""
    fs, _ = storage.filesystem(listing.url)
    if "s3" not in storage.protocols(fs):
        return _get_remote_files(fs, listing, dest, progress)
    try:
        with s3session.pinned({e.path: e.etag for e in listing.entries if e.etag}):
            return _get_remote_files(fs, listing, dest, progress)
    except Exception as exc:
        if "PreconditionFailed" in f"{type(exc).__name__} {exc}" or "pre-conditions" in str(exc) or "412" in str(exc):
            raise ChangedWhileCopying([e.rel for e in listing.entries]) from None
        raise


def _get_remote_files(fs, listing: Listing, dest: Path, progress: TransferProgress) -> dict[str, bool | None]:
    rpaths = [e.path for e in listing.entries]
    lpaths = [str(dest / e.rel) for e in listing.entries]
    s3 = "s3" in storage.protocols(fs)
    streams = {"max_concurrency": STREAMS_PER_FILE} if s3 else {}
    if len(rpaths) == 1:
        entry = listing.entries[0]
        if s3 and STREAMS_PER_FILE == 1 and etag.checkable(entry.etag) and entry.size >= FOLLOW_BYTES:
            follower = etag.Follower(Path(lpaths[0]), entry.etag, entry.size)  # written front to back: hash as it lands
            try:
                fs.get_file(rpaths[0], lpaths[0], callback=_Tee(progress.callback(), follower), **streams)
            except BaseException:
                follower.close()
                raise
            return {entry.rel: follower.result()}
        fs.get_file(rpaths[0], lpaths[0], callback=progress.callback(), **streams)
    elif isinstance(fs, AsyncFileSystem):
        fs.get(rpaths, lpaths, callback=progress.callback(), batch_size=BATCH_SIZE, **streams)
    else:
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(lambda pair: fs.get_file(pair[0], pair[1], callback=progress.callback()), zip(rpaths, lpaths)))
    return {}


class _Tee(Callback):
    """fsspec callback of one sequential download: bytes to the progress
    callback and to the ETag :class:`~e31.tasks.storage.etag.Follower`."""

    def __init__(self, progress: Callback, follower: etag.Follower):
        super().__init__()
        self._progress, self._follower = progress, follower

    def set_size(self, size):
        self._progress.set_size(size)

    def relative_update(self, inc=1):
        self._progress.relative_update(inc)
        self._follower.advance(inc)


def verify(listing: Listing, dest: Path, checked: dict[str, bool | None] | None = None) -> str:
    """Check every copy under ``dest``: its size equals the listing's, and
    where the store gives an MD5-form ETag, the copy reproduces it (the
    answers in ``checked``, from :func:`fetch`, are used instead of hashing
    again).  Returns :func:`identity` of the copies; raises
    :class:`VerifyError` naming the first bad files."""
    checked = checked or {}
    try:
        raw = _scan(listing, dest)
    except OSError:
        raw = None  # gone or unreadable: the stat per file below says which
    copies = scan_local(str(dest), raw)[0] if raw is not None else _copies(listing, dest)
    bad = []
    for e in listing.entries:
        got = copies.get(e.rel)
        if got is None:
            bad.append(f"{e.rel}: missing after the copy")
        elif got[0] != e.size and e.size != UNKNOWN_SIZE:  # unknown: the declared sha256 is the check
            bad.append(f"{e.rel}: {got[0]} bytes copied, the source has {e.size}")
        elif not listing.local and (checked[e.rel] if e.rel in checked
                                    else etag.matches(dest / e.rel, e.etag, e.size)) is False:
            bad.append(f"{e.rel}: content differs from the store's ETag {e.etag}")
    if bad:
        raise VerifyError("; ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""))
    return scan_identity(raw) if raw is not None else _identity(listing, copies)


def make_read_only(listing: Listing, base: Path) -> None:
    """Make the staged copy's files read-only (mode 0444): the work reads
    its inputs and must not change them.  (A process running as root may
    still write; the copy's identity, which covers inode and ctime, then
    tells the next run to stage it again.)"""
    root = str(base)
    for e in listing.entries:
        try:
            os.chmod(f"{root}/{e.rel}", 0o444)
        except OSError:
            pass


def identity(listing: Listing, base: Path) -> str | None:
    """What the copy of ``listing`` under ``base`` looks like now, as a
    string (None when a file is missing or the copy cannot be read): a copy
    changed in place, grown or shrunk since it was staged has another one --
    even one rewritten with the same size and its mtime set back, since the
    inode number and ctime (which no process can set back) count too.

    A folder of several files: the sha256 of its :func:`find_output` scan
    (every name, size, mtime, inode and ctime; files added count too).  Else
    (or without GNU find) a sha256 over those of each listed file's copy.
    """
    try:
        raw = _scan(listing, base)
    except OSError:
        return None
    return scan_identity(raw) if raw is not None else _identity(listing, _copies(listing, base))


def _scan(listing: Listing, base: Path) -> bytes | None:
    """:func:`find_output` of the copy's folder, whatever the input's kind
    (None: no GNU find).  Raises ``OSError`` when the copy cannot be scanned."""
    return find_output(str(base))  # any kind: a file added beside a staged file changes it too


def scan_identity(raw: bytes) -> str:
    """The :func:`identity` of a copy whose folder scanned as ``raw``
    (:func:`e31.tasks.storage.listing.find_output`)."""
    return "scan:" + hashlib.sha256(raw).hexdigest()


def _copies(listing: Listing, base: Path) -> dict[str, tuple[int, str]]:
    """``{rel: (size, mtime)}`` of the listed files' copies under ``base``
    that exist: one scan of the tree for a folder, a stat per file else."""
    root = str(base)
    if listing.kind == "folder" and len(listing.entries) > 1:
        try:
            return scan_local(root)[0]
        except OSError:
            pass  # gone or unreadable: the stat per file below says which
    found = {}
    for e in listing.entries:
        try:
            st = os.stat(f"{root}/{e.rel}")
        except OSError:
            continue
        found[e.rel] = (st.st_size, f"{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}")
    return found


def _identity(listing: Listing, copies: dict[str, tuple[int, str]]) -> str | None:
    parts = []  # hashed in one update: 10,000 small updates cost ~10x more
    for e in listing.entries:
        got = copies.get(e.rel)
        if got is None:
            return None
        parts.append(f"{e.rel}\0{got[0]}\0{got[1]}\n")
    return hashlib.sha256("".join(parts).encode("utf-8", "surrogateescape")).hexdigest()


def changed_since(before: Listing, after: Listing) -> list[str]:
    """Relative paths whose size or version differs between two listings of
    the same URL (including files that appeared or vanished)."""
    old = {e.rel: (e.size, e.version) for e in before.entries}
    new = {e.rel: (e.size, e.version) for e in after.entries}
    return sorted(rel for rel in old.keys() | new.keys() if old.get(rel) != new.get(rel))
