"""Parsing and formatting of durations (seconds) and memory sizes (bytes).

Pure functions with no pydantic dependency; the models wrap them to give
field-specific messages.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Decimal, InvalidOperation

__all__ = [
    "DURATION_EXAMPLES",
    "DURATION_PATTERN",
    "MEMORY_EXAMPLES",
    "MEMORY_PATTERN",
    "format_duration",
    "format_memory",
    "parse_duration",
    "parse_memory",
]

DURATION_EXAMPLES = "90s, 10m, 4h, 1d, 1h30m, 04:00:00 or PT4H, or a number of seconds"
MEMORY_EXAMPLES = "512MB, 1.5GB, 4GiB or a number of bytes"

_NUM = r"\d+(?:\.\d+)?"

# Unit words accepted in the compact form, largest first; lower case only.
_UNITS: tuple[tuple[tuple[str, ...], int], ...] = (
    (("w", "week", "weeks"), 7 * 86400),
    (("d", "day", "days"), 86400),
    (("h", "hr", "hrs", "hour", "hours"), 3600),
    (("m", "min", "mins", "minute", "minutes"), 60),
    (("s", "sec", "secs", "second", "seconds"), 1),
)
_UNIT_SECONDS = {word: (rank, secs) for rank, (words, secs) in enumerate(_UNITS) for word in words}

_PART = re.compile(rf"\s*({_NUM})\s*([A-Za-z]+)\s*")
_CLOCK = re.compile(r"(\d+):(\d\d)(?::(\d\d(?:\.\d+)?))?")
_ISO = re.compile(
    r"P(?:(?P<Y>\d+(?:[.,]\d+)?)Y)?(?:(?P<W>\d+(?:[.,]\d+)?)W)?(?:(?P<D>\d+(?:[.,]\d+)?)D)?"
    r"(?:T(?:(?P<H>\d+(?:[.,]\d+)?)H)?(?:(?P<M>\d+(?:[.,]\d+)?)M)?(?:(?P<S>\d+(?:[.,]\d+)?)S)?)?"
)
_ISO_SECONDS = {"Y": 365 * 86400, "W": 7 * 86400, "D": 86400, "H": 3600, "M": 60, "S": 1}

#: ECMA-262 regular expression (for JSON Schema) matching every string form
#: that :func:`parse_duration` accepts (it may match a few it refuses).
DURATION_PATTERN = (
    r"^\s*(?:"
    r"(?:\d+(?:\.\d+)?\s*(?:w|weeks?|d|days?|h|hrs?|hours?|m|mins?|minutes?|s|secs?|seconds?)\s*)+"
    r"|\d+(?:\.\d+)?"
    r"|\d+:\d\d(?::\d\d(?:\.\d+)?)?"
    r"|P(?:\d+(?:[.,]\d+)?[YWD])*(?:T(?:\d+(?:[.,]\d+)?[HMS])+)?"
    r")\s*$"
)

_MEMORY = re.compile(rf"\s*({_NUM})\s*([A-Za-z]*)\s*")
_PREFIX = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5, "e": 6}

#: ECMA-262 regular expression (for JSON Schema) matching memory strings.
MEMORY_PATTERN = r"^\s*\d+(?:\.\d+)?\s*(?:[KkMmGgTtPpEe][Ii]?[Bb]?|[Bb])?\s*$"


def _to_timedelta(seconds: Decimal) -> timedelta:
    micro = (seconds * 1_000_000).to_integral_value(rounding=ROUND_HALF_EVEN)
    try:
        return timedelta(microseconds=int(micro))
    except OverflowError:
        raise ValueError(f"duration is too long: {seconds} seconds") from None


def _dec(text: str) -> Decimal:
    return Decimal(text.replace(",", "."))


def _parse_compact(text: str) -> Decimal | None:
    pos, total, last_rank = 0, Decimal(0), -1
    while pos < len(text):
        match = _PART.match(text, pos)
        if not match:
            return None
        number, unit = match.groups()
        if unit not in _UNIT_SECONDS:
            raise ValueError(f"unknown duration unit {unit!r}; use w, d, h, m or s (lower case)")
        rank, secs = _UNIT_SECONDS[unit]
        if rank <= last_rank:
            raise ValueError("each unit may appear once, largest first, as in 1h30m")
        last_rank = rank
        total += _dec(number) * secs
        pos = match.end()
    return total if pos else None


def _parse_clock(text: str) -> Decimal | None:
    match = _CLOCK.fullmatch(text)
    if not match:
        return None
    first, second, third = match.groups()
    if third is None:  # MM:SS
        minutes, seconds = int(first), Decimal(second)
        if seconds >= 60:
            raise ValueError("seconds must be below 60 in MM:SS")
        return minutes * 60 + seconds
    hours, minutes, seconds = int(first), int(second), Decimal(third)
    if minutes >= 60 or seconds >= 60:
        raise ValueError("minutes and seconds must be below 60 in HH:MM:SS")
    return hours * 3600 + minutes * 60 + seconds


def _parse_iso(text: str) -> Decimal | None:
    if not text.startswith("P"):
        return None
    match = _ISO.fullmatch(text)
    if not match or text in ("P", "PT") or text.endswith("T"):
        if re.fullmatch(r"P(?:\d+Y)?\d+M.*", text):
            raise ValueError("months have no fixed length; use days, e.g. P30D")
        return None
    return sum(
        (_dec(v) * _ISO_SECONDS[k] for k, v in match.groupdict().items() if v is not None),
        Decimal(0),
    )


def parse_duration(value: object) -> timedelta:
    """Parse a duration into a :class:`datetime.timedelta`.

    Accepts a ``timedelta``; an ``int`` or ``float`` number of seconds; or a
    string: a number of seconds (``"90"``), compact units largest first
    (``"90s"``, ``"10m"``, ``"4h"``, ``"1d"``, ``"1h30m"``, ``"1.5h"``; units
    w, d, h, m, s, lower case, long forms such as ``min`` or ``hours`` too),
    a clock (``"H:MM:SS"``, ``"HH:MM:SS"``, ``"MM:SS"``) or ISO 8601
    (``"PT4H"``, ``"P1DT2H"``, ``"PT1.5S"``; ``Y`` counts 365 days, as
    pydantic writes it; months are refused). Zero is allowed here; callers
    decide whether it is meaningful.

    Raises:
        ValueError: the value is not one of those forms, is negative, not
            finite, or too long for a timedelta.
    """
    if isinstance(value, timedelta):
        if value < timedelta(0):
            raise ValueError(f"a duration cannot be negative (got {value})")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a duration such as {DURATION_EXAMPLES} (got {value!r})")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"a duration must be finite (got {value!r})")
        if value < 0:
            raise ValueError(f"a duration cannot be negative (got {value!r})")
        return _to_timedelta(Decimal(str(value)))
    text = value.strip()
    if text.startswith("-"):
        raise ValueError(f"a duration cannot be negative (got {value!r})")
    seconds: Decimal | None = None
    if re.fullmatch(_NUM, text):
        seconds = Decimal(text)
    else:
        for parse in (_parse_iso, _parse_clock, _parse_compact):
            seconds = parse(text)
            if seconds is not None:
                break
    if seconds is None:
        raise ValueError(f"expected a duration such as {DURATION_EXAMPLES} (got {value!r})")
    return _to_timedelta(seconds)


def format_duration(value: timedelta) -> str:
    """Format a timedelta compactly for messages: ``1d2h``, ``1h30m``, ``90s`` -> ``1m30s``."""
    total = Decimal(value.days * 86400 + value.seconds) + Decimal(value.microseconds) / 1_000_000
    if total == 0:
        return "0s"
    sign = "-" if total < 0 else ""
    total = abs(total)
    parts = []
    for unit, secs in (("d", 86400), ("h", 3600), ("m", 60)):
        count, total = divmod(total, secs)
        if count:
            parts.append(f"{int(count)}{unit}")
    if total:
        parts.append(f"{total.normalize():f}s")
    return sign + "".join(parts)


def parse_memory(value: object) -> int:
    """Parse a memory size into a whole number of BYTES.

    Accepts an ``int`` (bytes), an integral ``float``, or a string: a number
    with an optional unit, case-insensitive: ``B``; SI powers of 1000 ``k``,
    ``kB``, ``M``, ``MB``, ``G``, ``GB``, ``T``, ``TB``, ``P``, ``PB``; IEC
    powers of 1024 ``Ki``, ``KiB``, ``Mi``, ``MiB``, ``Gi``, ``GiB``, ... .
    Examples: ``"512MB"`` -> 512_000_000, ``"4GiB"`` -> 4_294_967_296,
    ``"1.5GB"`` -> 1_500_000_000. A fraction of a byte rounds up.

    Raises:
        ValueError: not one of those forms, negative, or not finite.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a memory size such as {MEMORY_EXAMPLES} (got {value!r})")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"a memory size must be finite (got {value!r})")
        value = Decimal(str(value))
    if not isinstance(value, str):
        if value < 0:
            raise ValueError(f"a memory size cannot be negative (got {value})")
        return int(Decimal(value).to_integral_value(rounding=ROUND_CEILING))
    match = _MEMORY.fullmatch(value)
    if not match:
        if value.strip().startswith("-"):
            raise ValueError(f"a memory size cannot be negative (got {value!r})")
        raise ValueError(f"expected a memory size such as {MEMORY_EXAMPLES} (got {value!r})")
    number, unit = match.groups()
    unit_match = re.fullmatch(r"(?i)([kmgtpe]?)(i?)(b?)", unit)
    if not unit_match or (unit_match.group(2) and not unit_match.group(1)):
        raise ValueError(f"unknown memory unit {unit!r}; use B, kB, MB, GB, TB or KiB, MiB, GiB, TiB")
    prefix, binary, _ = unit_match.groups()
    base = 1024 if binary else 1000
    try:
        size = Decimal(number) * base ** _PREFIX[prefix.lower()]
    except InvalidOperation:  # pragma: no cover - regex guarantees a number
        raise ValueError(f"expected a memory size such as {MEMORY_EXAMPLES} (got {value!r})") from None
    return int(size.to_integral_value(rounding=ROUND_CEILING))


_SIZE_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024),
               ("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("kB", 1000), ("B", 1))


def format_memory(size: int) -> str:
    """A size in BYTES as a person writes it: the shortest exact form with
    at most five digits before the point and three after, in the units :func:`parse_memory` reads
    (``4294967296`` -> ``4GiB``, ``512000000`` -> ``512MB``, ``1500000000``
    -> ``1.5GB``), so parsing the text gives ``size`` back; a size with no
    such form is shown to two decimals of the largest binary unit it
    reaches, marked approximate, with its bytes (``1234567891`` ->
    ``~1.15GiB (1234567891 bytes)``); under 1000 bytes, ``999B``."""
    if size < 1000:
        return f"{size}B"
    exact = []
    for unit, factor in _SIZE_UNITS[:-1]:
        value = Decimal(size) / factor
        if 1 <= value < 100_000 and value == value.quantize(Decimal("0.001")):
            exact.append(f"{value.normalize():f}{unit}")
    if exact:
        return min(exact, key=len)
    unit, factor = next((u, f) for u, f in _SIZE_UNITS[:4] if size >= f)
    return f"~{size / factor:.2f}{unit} ({size} bytes)"
