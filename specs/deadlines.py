"""Deadlines that follow a schedule: relative to each run's scheduled start
(``deadline_within: 4h``) or a time of day in a named timezone
(``deadline_at: "06:00 Europe/London"``).  An absolute ``deadline`` would be
in the past after the first night of a nightly job.  The absolute ``Deadline``
type (aware, in the future) is here too."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, time, timedelta, timezone
from typing import Annotated
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import AfterValidator, WithJsonSchema

from .base import spec_error

_AT_FIX = 'write a 24-hour time and an IANA timezone, e.g. "06:00 Europe/London"'


def parse_time_of_day(value: str) -> tuple[time, str]:
    """``"06:00 Europe/London"`` -> ``(time(6, 0), "Europe/London")``.
    Raises ``ValueError`` (a spec error) for a bad time or unknown timezone."""
    parts = value.split()
    if len(parts) != 2:
        raise spec_error("must be a time of day and a timezone", fix=_AT_FIX)
    clock, zone = parts
    try:
        at = time.fromisoformat(clock)
    except ValueError:
        raise spec_error(f"'{clock}' is not a time of day (HH:MM)", fix=_AT_FIX) from None
    try:
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError):
        raise spec_error(f"'{zone}' is not a known IANA timezone", fix=_AT_FIX) from None
    return at, zone


def _check_at(value: str) -> str:
    parse_time_of_day(value)
    return value


#: A daily deadline: a time of day with its IANA timezone.
DeadlineAt = Annotated[str, AfterValidator(_check_at), WithJsonSchema({
    "type": "string", "pattern": r"^\d{1,2}:\d\d(:\d\d)? \S+$", "examples": ["06:00 Europe/London"],
})]


def next_time_of_day(value: str, start: datetime) -> datetime:
    """The first moment at or after ``start`` (timezone-aware) when the wall
    clock of the value's timezone shows its time of day.  On a day when that
    time does not exist (spring forward) it is the same instant one offset
    later, as ``zoneinfo`` resolves it."""
    at, zone = parse_time_of_day(value)
    tz = ZoneInfo(zone)
    local = start.astimezone(tz)
    candidate = datetime.combine(local.date(), at, tzinfo=tz)
    if candidate < start:
        candidate = datetime.combine(local.date() + timedelta(days=1), at, tzinfo=tz)
    return candidate


def _deadline_schema() -> dict:
    return {
        "type": "string",
        "format": "date-time",
        "pattern": r"(?:[Zz]|[+-]\d\d:?\d\d)$",
    }


_AS_OF: ContextVar[datetime | None] = ContextVar("e31_deadlines_as_of", default=None)


@contextmanager
def deadlines_as_of(moment: datetime | None) -> Iterator[None]:
    """Judge whether a deadline is still in the future as of ``moment`` (timezone-aware) instead of
    the clock, for specs validated inside the block: ``e31 plan --now T`` plans as of ``T``, so a
    deadline is in the past only when it is before ``T``.  None: the clock."""
    token = _AS_OF.set(moment)
    try:
        yield
    finally:
        _AS_OF.reset(token)


def check_deadline(value: datetime) -> datetime:
    """Require a timezone and a deadline still in the future (as of :func:`deadlines_as_of`'s
    moment inside that block, else now)."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise spec_error(
            "must include a timezone; a deadline without one is not guessed",
            fix=f"add an offset, e.g. {value.replace(tzinfo=None).isoformat()}+00:00",
            got=repr(value.isoformat()),
        )
    as_of = _AS_OF.get()
    now = as_of if as_of is not None else datetime.now(timezone.utc)
    if value <= now:
        raise spec_error(
            "must be in the future; this deadline has already passed" if as_of is None else
            f"must be after the planning time {as_of.isoformat()} (--now); this deadline has passed by then",
            fix="set a later finish-by time, or drop the deadline",
            got=repr(value.isoformat()),
        )
    return value


#: An aware datetime in the future.
Deadline = Annotated[datetime, AfterValidator(check_deadline), WithJsonSchema(_deadline_schema())]
