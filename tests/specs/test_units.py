"""Duration and memory parsing: exact seconds and bytes."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest

from e31.specs import parse_duration, parse_memory
from e31.specs.units import DURATION_PATTERN, MEMORY_PATTERN, format_duration

DURATIONS = [
    ("90s", 90),
    ("10m", 600),
    ("4h", 14400),
    ("1d", 86400),
    ("1w", 604800),
    ("1h30m", 5400),
    ("1d2h3m4s", 93784),
    ("1h 30m", 5400),
    ("1.5h", 5400),
    ("2 hours", 7200),
    ("45 min", 2700),
    ("4:00:00", 14400),
    ("04:00:00", 14400),
    ("100:00:00", 360000),
    ("1:02:03", 3723),
    ("01:30", 90),
    ("90:00", 5400),
    ("00:00:01.5", 1.5),
    ("PT4H", 14400),
    ("P1DT2H", 93600),
    ("PT30M", 1800),
    ("PT1.5S", 1.5),
    ("PT1,5S", 1.5),
    ("P1W", 604800),
    ("P1Y35D", 400 * 86400),
    ("PT0S", 0),
    ("90", 90),
    (" 10m ", 600),
    (90, 90),
    (1.25, 1.25),
    (0, 0),
    (timedelta(minutes=3), 180),
]


@pytest.mark.parametrize(("value", "seconds"), DURATIONS, ids=[repr(v) for v, _ in DURATIONS])
def test_parse_duration(value, seconds):
    assert parse_duration(value).total_seconds() == seconds


@pytest.mark.parametrize(("value", "seconds"), [d for d in DURATIONS if isinstance(d[0], str)])
def test_duration_schema_pattern_accepts_every_accepted_string(value, seconds):
    assert re.search(DURATION_PATTERN, value)


BAD_DURATIONS = [
    ("soon", "expected a duration such as 90s, 10m, 4h, 1d, 1h30m, 04:00:00 or PT4H, "
             "or a number of seconds (got 'soon')"),
    ("", "expected a duration such as 90s, 10m, 4h, 1d, 1h30m, 04:00:00 or PT4H, "
         "or a number of seconds (got '')"),
    ("10x", "unknown duration unit 'x'; use w, d, h, m or s (lower case)"),
    ("4H", "unknown duration unit 'H'; use w, d, h, m or s (lower case)"),
    ("30m1h", "each unit may appear once, largest first, as in 1h30m"),
    ("P1M", "months have no fixed length; use days, e.g. P30D"),
    ("1:60", "seconds must be below 60 in MM:SS"),
    ("1:60:00", "minutes and seconds must be below 60 in HH:MM:SS"),
    ("PT", "expected a duration such as 90s, 10m, 4h, 1d, 1h30m, 04:00:00 or PT4H, "
           "or a number of seconds (got 'PT')"),
    ("-5s", "a duration cannot be negative (got '-5s')"),
    (-1, "a duration cannot be negative (got -1)"),
    (float("nan"), "a duration must be finite (got nan)"),
    (True, "expected a duration such as 90s, 10m, 4h, 1d, 1h30m, 04:00:00 or PT4H, "
           "or a number of seconds (got True)"),
    (None, "expected a duration such as 90s, 10m, 4h, 1d, 1h30m, 04:00:00 or PT4H, "
           "or a number of seconds (got None)"),
]


@pytest.mark.parametrize(("value", "message"), BAD_DURATIONS, ids=[repr(v) for v, _ in BAD_DURATIONS])
def test_parse_duration_refuses(value, message):
    with pytest.raises(ValueError) as info:
        parse_duration(value)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("delta", "text"),
    [
        (timedelta(0), "0s"),
        (timedelta(seconds=90), "1m30s"),
        (timedelta(hours=1, minutes=30), "1h30m"),
        (timedelta(days=1, hours=2), "1d2h"),
        (timedelta(seconds=1.5), "1.5s"),
    ],
)
def test_format_duration(delta, text):
    assert format_duration(delta) == text
    assert parse_duration(text) == delta


MEMORY = [
    ("4GiB", 4 * 1024**3),
    ("512MB", 512_000_000),
    ("1.5GB", 1_500_000_000),
    ("100KiB", 102_400),
    ("2GiB", 2_147_483_648),
    ("1kB", 1000),
    ("1KB", 1000),
    ("1k", 1000),
    ("1Ki", 1024),
    ("16gib", 16 * 1024**3),
    ("1TB", 10**12),
    ("1TiB", 1024**4),
    ("1PB", 10**15),
    ("64B", 64),
    ("64", 64),
    ("1.5 MiB", 1_572_864),
    ("0.5B", 1),
    (1024, 1024),
    (1.5e9, 1_500_000_000),
    (0, 0),
]


@pytest.mark.parametrize(("value", "size"), MEMORY, ids=[repr(v) for v, _ in MEMORY])
def test_parse_memory(value, size):
    result = parse_memory(value)
    assert result == size
    assert type(result) is int


@pytest.mark.parametrize(("value", "size"), [m for m in MEMORY if isinstance(m[0], str)])
def test_memory_schema_pattern_accepts_every_accepted_string(value, size):
    assert re.search(MEMORY_PATTERN, value)


BAD_MEMORY = [
    ("4 gigs", "unknown memory unit 'gigs'; use B, kB, MB, GB, TB or KiB, MiB, GiB, TiB"),
    ("iB", "expected a memory size such as 512MB, 1.5GB, 4GiB or a number of bytes (got 'iB')"),
    ("4iB", "unknown memory unit 'iB'; use B, kB, MB, GB, TB or KiB, MiB, GiB, TiB"),
    ("lots", "expected a memory size such as 512MB, 1.5GB, 4GiB or a number of bytes (got 'lots')"),
    ("-1GB", "a memory size cannot be negative (got '-1GB')"),
    (-5, "a memory size cannot be negative (got -5)"),
    (True, "expected a memory size such as 512MB, 1.5GB, 4GiB or a number of bytes (got True)"),
    (float("inf"), "a memory size must be finite (got inf)"),
]


@pytest.mark.parametrize(("value", "message"), BAD_MEMORY, ids=[repr(v) for v, _ in BAD_MEMORY])
def test_parse_memory_refuses(value, message):
    with pytest.raises(ValueError) as info:
        parse_memory(value)
    assert str(info.value) == message
