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
import re
from pathlib import Path

_MIB = 2**20
#: Part sizes (bytes) of common uploaders: boto3/aws cli 8 MiB, s3fs 50 MiB, others.
PART_SIZES = (8 * _MIB, 50 * _MIB, 5 * _MIB, 16 * _MIB, 64 * _MIB, 100 * _MIB, 128 * _MIB, 15 * _MIB, 10 * _MIB)
_SINGLE = re.compile(r"^[0-9a-f]{32}$")
_MULTI = re.compile(r"^([0-9a-f]{32})-(\d+)$")
_BLOCK = 4 * _MIB


def md5_file(path: Path) -> str:
    """MD5 hex digest of a local file (read in 4 MiB blocks)."""
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def multipart_etag(path: Path, part_size: int) -> str:
    """The ETag S3 gives ``path`` uploaded in parts of ``part_size`` bytes."""
    digests = []
    with open(path, "rb") as fh:
        while True:
            h = hashlib.md5(usedforsecurity=False)
            left = part_size
            while left:
                block = fh.read(min(_BLOCK, left))
                if not block:
                    break
                h.update(block)
                left -= len(block)
            if left == part_size:
                break
            digests.append(h.digest())
            if left:
                break
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
