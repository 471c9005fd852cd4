"""Durations (timedelta, seconds) and memory sizes (bytes) as spec fields,
each bounded: a sane upper limit, said in the message."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from pydantic import BeforeValidator, WithJsonSchema

from .base import spec_error
from .units import DURATION_EXAMPLES, DURATION_PATTERN, MEMORY_EXAMPLES, MEMORY_PATTERN, format_duration, parse_duration, parse_memory

__all__ = ["MAX_DURATION", "MAX_MEMORY", "MAX_URL", "Duration", "Grace", "Memory"]

_DURATION_SCHEMA = {
    "anyOf": [
        {"type": "string", "pattern": DURATION_PATTERN},
        {"type": "number", "minimum": 0},
    ],
}


#: The longest duration a spec may give (a time limit of a year is already no batch job).
MAX_DURATION = timedelta(days=366)
#: The most memory a request may ask for, in bytes (64 TiB: larger than any one machine).
MAX_MEMORY = 64 * 2**40
#: The longest URL or path a spec may give, in characters.
MAX_URL = 4096


def _duration(value: Any, *, allow_zero: bool) -> timedelta:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        raise spec_error(f"must be at most {MAX_DURATION.days} days", got="an integer of about "
                         f"{int(value.bit_length() * 0.30103)} digits")
    try:
        result = parse_duration(value)
    except ValueError as exc:
        if "negative" in str(exc):
            raise spec_error("must not be negative") from None
        hint = str(exc) if not str(exc).startswith("expected") and "(got" not in str(exc) else None
        raise spec_error(f"must be a duration such as {DURATION_EXAMPLES}", fix=hint) from None
    if not allow_zero and result <= timedelta(0):
        raise spec_error("must be longer than 0 seconds")
    if result > MAX_DURATION:
        raise spec_error(f"must be at most {MAX_DURATION.days} days", got=format_duration(result))
    return result


#: A duration > 0, in any form :func:`e31.specs.units.parse_duration` accepts.
Duration = Annotated[
    timedelta,
    BeforeValidator(lambda v: _duration(v, allow_zero=False)),
    WithJsonSchema(_DURATION_SCHEMA),
]

#: A duration >= 0.
Grace = Annotated[
    timedelta,
    BeforeValidator(lambda v: _duration(v, allow_zero=True)),
    WithJsonSchema(_DURATION_SCHEMA),
]


def _memory(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        raise spec_error("must be at most 64 TiB", got=f"an integer of about {int(value.bit_length() * 0.30103)} digits")
    try:
        result = parse_memory(value)
    except ValueError as exc:
        if "negative" in str(exc):
            raise spec_error("must not be negative") from None
        hint = str(exc) if str(exc).startswith("unknown") else None
        raise spec_error(f"must be a memory size such as {MEMORY_EXAMPLES}", fix=hint) from None
    if result <= 0:
        raise spec_error("must be more than 0 bytes")
    if result > MAX_MEMORY:
        raise spec_error("must be at most 64 TiB", got=f"{result} bytes")
    return result


#: Memory in BYTES; strings such as 4GiB or 512MB are accepted.
Memory = Annotated[
    int,
    BeforeValidator(_memory),
    WithJsonSchema({
        "anyOf": [
            {"type": "string", "pattern": MEMORY_PATTERN},
            {"type": "integer", "minimum": 1},
        ],
    }),
]


