"""Check a local copy against an object store's ETag.

S3 and S3-compatible stores give a single-part object the MD5 of its bytes
as its ETag, and a multipart object ``md5(md5(part1) + ... + md5(partN))-N``
(the AWS S3 user guide, "Checking object integrity").  The part size is not
recorded, so the sizes common clients use are tried: a copy is accepted when
one of them reproduces the ETag.  Other stores' ETags (GCS, Azure) are
opaque: :func:`matches` then answers None (cannot tell).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_MIB = 2**20
#: Part sizes (bytes) of common uploaders: boto3/aws cli 8 MiB, s3fs 50 MiB, others.
PART_SIZES = (8 * _MIB, 50 * _MIB, 5 * _MIB, 16 * _MIB, 64 * _MIB, 100 * _MIB, 128 * _MIB, 15 * _MIB, 10 * _MIB)
_SINGLE = re.compile(r"^[0-9a-f]{32}$")
_MULTI = re.compile(r"^([0-9a-f]{32})-(\d+)$")
_BLOCK = 4 * _MIB
#: Threads hashing the parts of a multipart object (one per usable core).
HASH_THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def md5_file(path: Path) -> str:
    """MD5 hex digest of a local file (read in 4 MiB blocks)."""
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def multipart_etag(path: Path, part_size: int) -> str:
    """The ETag S3 gives ``path`` uploaded in parts of ``part_size`` bytes.

    Parts are hashed in parallel (:data:`HASH_THREADS` threads; ``hashlib``
    releases the GIL), so a 1 GiB file takes ~1/N of a serial MD5 pass."""
    size = os.path.getsize(path)
    offsets = range(0, size, part_size) if size else []
    fd = os.open(path, os.O_RDONLY)
    try:
        def part(offset: int) -> bytes:
            h = hashlib.md5(usedforsecurity=False)
            end = min(offset + part_size, size)
            while offset < end:
                block = os.pread(fd, min(_BLOCK, end - offset), offset)
                if not block:
                    break
                h.update(block)
                offset += len(block)
            return h.digest()

        if len(offsets) > 1 and HASH_THREADS > 1:
            with ThreadPoolExecutor(min(HASH_THREADS, len(offsets))) as pool:
                digests = list(pool.map(part, offsets))
        else:
            digests = [part(o) for o in offsets]
    finally:
        os.close(fd)
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"


def matches(path: Path, etag: str | None, size: int) -> bool | None:
    """True when the local file at ``path`` (``size`` bytes) has the content
    ``etag`` names, False when a single-part ETag (the MD5) differs, None
    when there is nothing to check: not an MD5 form, or a multipart ETag none
    of :data:`PART_SIZES` reproduces."""
    if not etag:
        return None
    etag = etag.strip('"').lower()
    if _SINGLE.match(etag):
        return md5_file(path) == etag
    multi = _MULTI.match(etag)
    if not multi:
        return None
    parts = int(multi.group(2))
    candidates = [p for p in PART_SIZES if math.ceil(size / p) == parts] or (
        [math.ceil(size / parts)] if parts else []
    )
    if any(multipart_etag(path, p) == etag for p in candidates):
        return True
    return None  # an uploader with another part size: cannot tell (size and version are still checked)


class Follower:
    """Hashes a file for its ETag while another thread writes it front to
    back, so the check costs (almost) no time after the download.

    The writer calls :meth:`advance` with each chunk's byte count; a worker
    thread reads what has been written (from the page cache) and keeps one
    MD5 per part (the whole file for a single-part ETag; the first of
    :data:`PART_SIZES` that gives the ETag's part count for a multipart one).
    :meth:`result` waits for the rest and answers like :func:`matches`
    (trying the other part sizes after the download when the first does not
    reproduce a multipart ETag).  :meth:`close` stops the worker on failure.
    """

    _NOTIFY_EVERY = 8 * _MIB

    def __init__(self, path: Path, etag: str, size: int):
        self.path, self.etag, self.size = Path(path), etag.strip('"').lower(), size
        multi = _MULTI.match(self.etag)
        if multi:
            parts = int(multi.group(2))
            sizes = [p for p in PART_SIZES if math.ceil(size / p) == parts] or [math.ceil(size / max(parts, 1))]
            self.part_size = max(sizes[0], 1)
        else:
            self.part_size = max(size, 1)
        self._written = self._notified = 0
        self._digests: list[bytes] = []
        self._cv = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, daemon=True, name="e31-etag")
        self._thread.start()

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more bytes were written at the end of the file."""
        self._written += nbytes
        if self._written - self._notified >= self._NOTIFY_EVERY or self._written >= self.size:
            with self._cv:
                self._notified = self._written
                self._cv.notify()

    def _work(self) -> None:
        fd = None
        try:
            pos, h = 0, hashlib.md5(usedforsecurity=False)
            while True:
                with self._cv:
                    while self._notified <= pos and not self._stop:
                        self._cv.wait()
                    upto, stop = self._notified, self._stop
                if upto <= pos and stop:
                    break
                if fd is None:
                    fd = os.open(self.path, os.O_RDONLY)
                while pos < upto:
                    block = os.pread(fd, min(_BLOCK, upto - pos, self.part_size - pos % self.part_size), pos)
                    if not block:  # announced but still in the writer's buffer (or never written)
                        if stop:
                            upto = None
                        else:
                            with self._cv:
                                self._cv.wait(0.002)
                        break
                    h.update(block)
                    pos += len(block)
                    if pos % self.part_size == 0:
                        self._digests.append(h.digest())
                        h = hashlib.md5(usedforsecurity=False)
                if upto is None:  # stopped, and the file is shorter than announced: result() checks it whole
                    break
            if pos % self.part_size:
                self._digests.append(h.digest())
            self._hashed = pos
        except BaseException as exc:  # reported by result()
            self._error = exc
        finally:
            if fd is not None:
                os.close(fd)

    def close(self) -> None:
        """Stop the worker (after it hashed what was announced)."""
        with self._cv:
            self._notified = self._written
            self._stop = True
            self._cv.notify()
        self._thread.join()

    def result(self) -> bool | None:
        """After the download: True / False / None as :func:`matches`."""
        self.close()
        if self._error is not None or getattr(self, "_hashed", -1) != self.size:
            return matches(self.path, self.etag, self.size)
        if _SINGLE.match(self.etag):
            return self._digests[0].hex() == self.etag if self._digests else self.etag == hashlib.md5(b"").hexdigest()
        got = f"{hashlib.md5(b''.join(self._digests), usedforsecurity=False).hexdigest()}-{len(self._digests)}"
        return True if got == self.etag else matches(self.path, self.etag, self.size)


def checkable(etag: str | None) -> bool:
    """Whether ``etag`` has an MD5 form (single-part or multipart)."""
    return bool(etag) and bool(_SINGLE.match(etag.strip('"').lower()) or _MULTI.match(etag.strip('"').lower()))
