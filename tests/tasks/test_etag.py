"""ETag checks of staged copies: the ETags a real S3 server (SeaweedFS) gives
single-part and multipart uploads are reproduced from the local copy, both
after the download (:func:`tasks.etag.matches`, parts hashed in parallel)
and while it is being written (:class:`tasks.etag.Follower`); a corrupted
copy is refused.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from e31.tasks.storage import etag

MIB = 2**20


def _multipart(data: bytes, part: int) -> str:
    """The S3 multipart ETag of ``data`` uploaded in ``part``-byte parts,
    computed here independently of tasks.etag."""
    digests = [hashlib.md5(data[i:i + part]).digest() for i in range(0, len(data), part)]
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


def _write_slowly(path: Path, data: bytes, follower: etag.Follower, chunk: int = 65536) -> None:
    """Write ``data`` front to back in ``chunk``-byte writes, announcing each
    to ``follower`` as a download's callback does."""
    with open(path, "wb") as fh:
        for i in range(0, len(data), chunk):
            piece = data[i:i + chunk]
            fh.write(piece)
            fh.flush()
            follower.advance(len(piece))
            if i % (4 * MIB) == 0:
                time.sleep(0.001)  # let the follower catch up now and then


@pytest.mark.parametrize("part", [5 * MIB, 8 * MIB, 50 * MIB])
def test_store_etags_are_reproduced_after_and_during_the_download(s3_prefix, s3_server, tmp_path, part):
    """An object uploaded by s3fs in ``part``-byte parts (one part when the
    object is smaller): its ETag as the server reports it is reproduced by
    matches() and by a Follower fed while the copy is written."""
    data = os.urandom(21 * MIB + 12345)
    fs = s3_server.filesystem()
    url = f"{s3_prefix}obj.bin"
    fs.pipe(url, data, chunksize=part)
    tag = fs.info(url)["ETag"].strip('"')
    expected = _multipart(data, part) if len(data) > part else hashlib.md5(data).hexdigest()
    assert tag == expected  # the server's ETag is the documented MD5 form

    local = tmp_path / "obj.bin"
    fs.get_file(url, str(local))
    assert etag.matches(local, tag, len(data)) is True

    follower = etag.Follower(tmp_path / "followed.bin", tag, len(data))
    _write_slowly(tmp_path / "followed.bin", data, follower)
    assert follower.result() is True


def test_parallel_part_hashing_equals_a_serial_pass(tmp_path, monkeypatch):
    data = os.urandom(3 * 8 * MIB + 777)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    monkeypatch.setattr(etag, "HASH_THREADS", 4)
    assert etag.multipart_etag(path, 8 * MIB) == _multipart(data, 8 * MIB)
    monkeypatch.setattr(etag, "HASH_THREADS", 1)
    assert etag.multipart_etag(path, 8 * MIB) == _multipart(data, 8 * MIB)
    (tmp_path / "empty").write_bytes(b"")
    assert etag.multipart_etag(tmp_path / "empty", 8 * MIB) == f"{hashlib.md5(b'').hexdigest()}-0"


@pytest.mark.parametrize("multipart", [False, True])
def test_follower_refuses_a_corrupted_copy(tmp_path, multipart):
    """One flipped byte in the middle: a single-part ETag answers False (the
    copy is refused); a multipart one None (no part size reproduces it:
    cannot tell, as matches() answers)."""
    data = os.urandom(20 * MIB)
    tag = _multipart(data, 5 * MIB) if multipart else hashlib.md5(data).hexdigest()
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    follower = etag.Follower(tmp_path / "c.bin", tag, len(data))
    _write_slowly(tmp_path / "c.bin", bytes(bad), follower)
    assert follower.result() is (None if multipart else False)
    assert etag.matches(tmp_path / "c.bin", tag, len(data)) is (None if multipart else False)


def test_follower_of_a_truncated_download_checks_the_file_as_it_is(tmp_path):
    """A download that stopped early announced fewer bytes than the size:
    result() hashes the file itself, and a short file never matches."""
    data = os.urandom(9 * MIB)
    tag = hashlib.md5(data).hexdigest()
    follower = etag.Follower(tmp_path / "t.bin", tag, len(data))
    _write_slowly(tmp_path / "t.bin", data[:5 * MIB], follower)
    assert follower.result() is False


def test_follower_closed_after_a_failed_download_leaves_no_thread(tmp_path):
    before = {t.name for t in threading.enumerate()}
    follower = etag.Follower(tmp_path / "never-written.bin", hashlib.md5(b"x").hexdigest(), 1)
    follower.close()
    assert "e31-etag" not in {t.name for t in threading.enumerate()} - before


def test_follower_announced_more_than_was_written_ends_and_refuses(tmp_path):
    """Bytes announced but never written (a writer that died between its
    write and its flush): the worker does not wait for them forever, and
    the copy is checked as it is (too short: refused)."""
    data = os.urandom(3 * MIB)
    follower = etag.Follower(tmp_path / "short.bin", hashlib.md5(data).hexdigest(), len(data))
    (tmp_path / "short.bin").write_bytes(data[:MIB])
    follower.advance(len(data))
    started = time.monotonic()
    assert follower.result() is False
    assert time.monotonic() - started < 5
