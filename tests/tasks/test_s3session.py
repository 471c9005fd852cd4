"""The fast timestamp parser given to s3fs's botocore sessions
(tasks/s3session.py), against botocore's own parser and a real S3 server."""

from __future__ import annotations

import pytest
import s3fs
from botocore.utils import parse_timestamp as botocore_parse

from e31.tasks.storage import s3session

from e31.tasks import storage
from e31.tasks.storage.listing import list_input

SAMPLES = [
    "2026-11-30T03:22:18.123Z",
    "2026-11-30T03:22:18Z",
    "2026-11-30T03:22:18.1Z",
    "2026-11-30T03:22:18.123456Z",
    "2026-11-30T03:22:18.1234567Z",  # 7 digits: botocore's parser
    "2024-02-29T23:59:59.999Z",
    "Mon, 30 Nov 2026 03:22:18 GMT",
    "Sun, 01 Feb 2026 00:00:00 GMT",
    "Thu, 29 Feb 2024 12:00:00 GMT",
    "2026-11-30T03:22:18+02:00",  # an offset: botocore's parser
    "1700000000",  # epoch seconds: botocore's parser
    1700000000,
]


@pytest.mark.parametrize("value", SAMPLES)
def test_timestamps_equal_botocore(value):
    got, want = s3session.parse_timestamp(value), botocore_parse(value)
    assert got == want
    assert got.utcoffset() == want.utcoffset()


@pytest.mark.parametrize("value", ["Mon, 31 Feb 2026 03:22:18 GMT", "2026-13-01T00:00:00Z", "yesterday"])
def test_unreadable_timestamps_raise_what_botocore_raises(value):
    with pytest.raises(ValueError) as ours:
        s3session.parse_timestamp(value)
    with pytest.raises(ValueError) as theirs:
        botocore_parse(value)
    assert str(ours.value) == str(theirs.value)


def test_s3_filesystems_get_the_fast_parser_and_list_what_plain_s3fs_lists(s3_prefix, s3_server):
    plain = s3fs.S3FileSystem(skip_instance_cache=True)
    for i in range(25):
        plain.pipe(f"{s3_prefix}d{i % 3}/f{i:02d}", b"x" * i)
    fs, _ = storage.filesystem(s3_prefix)
    parser = fs.session.get_component("response_parser_factory").create_parser("rest-xml")
    assert parser._timestamp_parser is s3session.parse_timestamp

    ours = fs.find(s3_prefix, detail=True)
    plain.invalidate_cache()
    theirs = plain.find(s3_prefix, detail=True)
    assert len(ours) == 25
    assert {k: (v["size"], v["ETag"], v["LastModified"]) for k, v in ours.items()} == \
           {k: (v["size"], v["ETag"], v["LastModified"]) for k, v in theirs.items()}
    listing = list_input(s3_prefix)
    assert [e.rel for e in listing.entries] == sorted(f"d{i % 3}/f{i:02d}" for i in range(25))
    assert [e.size for e in listing.entries] == [int(e.rel[-2:]) for e in listing.entries]
    info = fs.info(f"{s3_prefix}d1/f04")  # a HEAD: Last-Modified from the header, through the fast parser
    assert info["LastModified"] == theirs[f"{s3_prefix[5:]}d1/f04"]["LastModified"]


def test_a_session_given_by_the_user_is_left_alone(s3_server):
    from aiobotocore.session import AioSession

    own = AioSession()
    fs = s3fs.S3FileSystem(session=own, skip_instance_cache=True)
    s3session.prepare(fs)
    assert fs.session is own
    fs = s3fs.S3FileSystem(skip_instance_cache=True, profile=None)
    s3session.prepare(fs)
    assert fs.session is not None and fs.session is not own
