"""botocore sessions for s3fs that read response timestamps quickly.

botocore turns every timestamp of a response into a ``datetime`` with
``dateutil.parser.parse`` (``botocore.utils.parse_timestamp``), ~0.1 ms per
call.  A listing of 10,000 objects carries 10,000 ``LastModified`` values:
measured on a local SeaweedFS server, s3fs's ``find`` took 1.05-1.13 s, of
which the timestamp parsing was more than half; with :func:`parse_timestamp`
it took 0.58-0.66 s.  Each download's ``Last-Modified`` header goes through
the same parser.

botocore's supported hook for this is the session's
``response_parser_factory`` component and its ``set_parser_defaults`` (the
AWS CLI sets its own timestamp parser the same way, in
``awscli/customizations/scalarparse.py``).  :func:`prepare` gives an s3fs
filesystem that has not connected yet such a session, built from the same
session arguments s3fs would use (``profile`` ...).

The same sessions pin downloads to one version of an object
(:func:`pinned`): each GetObject of an object being staged carries
``If-Match`` with the ETag it was listed with.
"""

from __future__ import annotations

import contextlib
import re
import threading
from datetime import datetime
from typing import Any

from botocore.utils import parse_timestamp as _botocore_parse
from dateutil.tz import tzutc

_UTC = tzutc()  # the tzinfo botocore gives "GMT" times
# ISO 8601 in UTC, as S3 listings give it: 2026-11-30T03:22:18.123Z
_ISO_Z = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,6})?Z")
# RFC 7231 IMF-fixdate, as HTTP headers give it: Mon, 30 Nov 2026 03:22:18 GMT
_HTTP_DATE = re.compile(r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), (\d\d) "
                        r"(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) (\d{4}) (\d\d):(\d\d):(\d\d) GMT")
_MONTHS = {m: i for i, m in enumerate("Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(), 1)}


def parse_timestamp(value: Any) -> datetime:
    """A response timestamp as a timezone-aware ``datetime`` equal to what
    ``botocore.utils.parse_timestamp`` returns for it.

    The two forms S3 sends (ISO 8601 ending in ``Z`` with up to 6 fractional
    digits; RFC 7231 ``IMF-fixdate``) are read with ``datetime`` directly,
    in UTC; anything else (epoch numbers, other offsets) goes to botocore's
    parser.  Raises ``ValueError`` as botocore does for a value neither reads.
    """
    if isinstance(value, str):
        try:
            if _ISO_Z.fullmatch(value):
                return datetime.fromisoformat(value[:-1]).replace(tzinfo=_UTC)
            m = _HTTP_DATE.fullmatch(value)
            if m:
                day, month, year, hh, mm, ss = m.groups()
                return datetime(int(year), _MONTHS[month], int(day), int(hh), int(mm), int(ss), tzinfo=_UTC)
        except ValueError:
            pass  # e.g. month 13 or 31 Feb: botocore's parser says what it says
    return _botocore_parse(value)


def session(**kwargs: Any):
    """A new ``aiobotocore`` session (``kwargs``: its arguments, e.g.
    ``profile``) whose clients parse timestamps with :func:`parse_timestamp`."""
    from aiobotocore.session import AioSession

    made = AioSession(**kwargs)
    made.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=parse_timestamp)
    made.register("before-parameter-build.s3.GetObject", _pin_version)
    return made


_PINNED: dict[tuple[str, str], str] = {}  # (bucket, key) -> the ETag every GET of it must match
_PINNED_LOCK = threading.Lock()


def _pin_version(params: dict, **_: Any) -> None:
    """botocore hook: a GET of a pinned object carries ``If-Match`` with the
    ETag it was listed with, so every ranged or resumed read is of that one
    version (a replaced object answers 412 instead of sending other bytes)."""
    with _PINNED_LOCK:
        tag = _PINNED.get((params.get("Bucket", ""), params.get("Key", "")))
    if tag and "IfMatch" not in params:
        params["IfMatch"] = f'"{tag}"'


@contextlib.contextmanager
def pinned(objects: dict[str, str]):
    """Within the block, every GET of an object in ``objects`` (``"bucket/key"``
    -> its listed ETag) must match that ETag (see :func:`_pin_version`)."""
    keys = {}
    for path, tag in objects.items():
        bucket, _, key = path.partition("/")
        if tag:
            keys[(bucket, key)] = tag.strip('"')
    with _PINNED_LOCK:
        _PINNED.update(keys)
    try:
        yield
    finally:
        with _PINNED_LOCK:
            for k in keys:
                _PINNED.pop(k, None)


def prepare(fs: Any) -> None:
    """Give ``fs`` a session from :func:`session` when it is an s3fs
    filesystem that has neither a session nor a client yet (s3fs creates
    both on first use; one given by the caller is left alone)."""
    if getattr(fs, "session", "absent") is not None or getattr(fs, "_s3", None) is not None:
        return
    try:
        from s3fs import S3FileSystem
    except ImportError:
        return
    if isinstance(fs, S3FileSystem):
        fs.session = session(**fs.kwargs)
