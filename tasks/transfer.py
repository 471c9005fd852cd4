"""Copy a listed input to compute-local disk, in parallel, and verify it.

* Local folders are copied by GNU ``cp -R`` (the fastest copier on this
  kind of machine: fsspec's local recursive copy is ~3x slower on 10,000
  small files); local single files by ``sendfile`` in 64 MiB steps (progress
  between steps).
* Async stores (s3, gs, az, http) get every file of a list in one fsspec
  ``get`` with ``batch_size`` concurrent transfers; other stores use a
  thread pool of ``get_file`` calls.
* :func:`verify` checks each copy's size, and its MD5 against the store's
  ETag where the ETag is one (see :mod:`tasks.etag`).

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

from tasks import etag, storage
from tasks.listing import Entry, Listing
from tasks.transferbar import TransferProgress

BATCH_SIZE = int(os.environ.get("E31_TRANSFER_BATCH", "32"))  # concurrent file transfers from a store
THREADS = 8  # get_file threads for stores without an async client
STEP = 64 * 2**20  # bytes per sendfile call on local copies


class ChangedWhileCopying(RuntimeError):
    """A source file changed (size, ETag or mtime) between the listing and
    the end of its copy; ``files`` names them (relative paths)."""

    def __init__(self, files: list[str]):
        super().__init__(f"{len(files)} file(s) changed while being copied: {', '.join(files[:5])}")
        self.files = files


class VerifyError(RuntimeError):
    """A copy does not match its source (size or ETag/MD5)."""


def fetch(listing: Listing, dest: Path, progress: TransferProgress) -> None:
    """Copy every entry of ``listing`` to ``dest / entry.rel`` and create its
    empty folders.  ``dest`` must not exist (it is created).  Raises what
    the filesystem raises; the caller removes ``dest`` on failure."""
    dest = Path(dest)
    if listing.local and listing.kind == "folder" and listing.entries and shutil.which("cp"):
        _cp_tree(listing.root, dest)
        progress.advance(listing.bytes)
    else:
        dest.mkdir(parents=True, exist_ok=False)
        for parent in sorted({str(Path(e.rel).parent) for e in listing.entries} - {"."}):
            (dest / parent).mkdir(parents=True, exist_ok=True)
        if listing.local:
            for e in listing.entries:
                _copy_local(e, dest / e.rel, progress)
        else:
            _get_remote(listing, dest, progress)
    for d in listing.dirs:
        (dest / d).mkdir(parents=True, exist_ok=True)


def _cp_tree(root: str, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    # -R recursive, -L follow symlinks (stage the data, not links back to the source), -T dest is the copy itself
    done = subprocess.run(["cp", "-RLT", "--", root, str(dest)], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"cp failed: {done.stderr.strip()[-500:]}")


def _copy_local(entry: Entry, target: Path, progress: TransferProgress) -> None:
    with open(entry.path, "rb") as src, open(target, "wb") as dst:
        offset = 0
        while True:
            sent = os.sendfile(dst.fileno(), src.fileno(), offset, STEP)
            if sent == 0:
                break
            offset += sent
            progress.advance(sent)


def _get_remote(listing: Listing, dest: Path, progress: TransferProgress) -> None:
    fs, _ = storage.filesystem(listing.url)
    rpaths = [e.path for e in listing.entries]
    lpaths = [str(dest / e.rel) for e in listing.entries]
    if len(rpaths) == 1:
        fs.get_file(rpaths[0], lpaths[0], callback=progress.callback())
    elif isinstance(fs, AsyncFileSystem):
        fs.get(rpaths, lpaths, callback=progress.callback(), batch_size=BATCH_SIZE)
    else:
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(lambda pair: fs.get_file(pair[0], pair[1], callback=progress.callback()), zip(rpaths, lpaths)))


def verify(listing: Listing, dest: Path) -> str:
    """Check every copy under ``dest``: its size equals the listing's, and
    where the store gives an MD5-form ETag, the copy reproduces it.  Returns
    :func:`identity` of the copies; raises :class:`VerifyError` naming the
    first bad files."""
    bad = []
    base = str(dest)
    h = hashlib.sha256()
    for e in listing.entries:
        local = f"{base}/{e.rel}"
        try:
            st = os.stat(local)
        except FileNotFoundError:
            bad.append(f"{e.rel}: missing after the copy")
            continue
        h.update(f"{e.rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        if st.st_size != e.size:
            bad.append(f"{e.rel}: {st.st_size} bytes copied, the source has {e.size}")
        elif not listing.local and etag.matches(Path(local), e.etag, e.size) is False:
            bad.append(f"{e.rel}: content differs from the store's ETag {e.etag}")
    if bad:
        raise VerifyError("; ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""))
    return h.hexdigest()


def identity(listing: Listing, base: Path) -> str | None:
    """sha256 over the size and mtime (ns) of each listed file's copy under
    ``base`` (None when one is missing): a staged copy changed in place since
    it was staged has another identity."""
    h = hashlib.sha256()
    root = str(base)
    for e in listing.entries:
        try:
            st = os.stat(f"{root}/{e.rel}")
        except OSError:
            return None
        h.update(f"{e.rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def changed_since(before: Listing, after: Listing) -> list[str]:
    """Relative paths whose size or version differs between two listings of
    the same URL (including files that appeared or vanished)."""
    old = {e.rel: (e.size, e.version) for e in before.entries}
    new = {e.rel: (e.size, e.version) for e in after.entries}
    return sorted(rel for rel in old.keys() | new.keys() if old.get(rel) != new.get(rel))
