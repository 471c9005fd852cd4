"""Recognising live or interactive work, which E31 refuses, and saying why."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import short_repr

__all__ = ["LIVE_KEYS", "LIVE_REASON", "find_live_keys", "got_key", "live_kind", "live_message"]

#: Why live work is refused and what is accepted instead (the tail of every message).
LIVE_REASON = (
    "such work does not belong on a batch queue and should run on local infrastructure "
    "(a service host or the machine itself); E31 accepts batch work that runs to an end "
    "with a declared output: kind training, inference, processing or simulation"
)

# Normalised kind (lower case, no '-', '_' or spaces) -> what it is, for the message.
_LIVE_KINDS = {
    "service": "a service",
    "server": "a server",
    "daemon": "a daemon",
    "interactive": "interactive work",
    "controlloop": "a control loop",
    "stream": "a stream",
    "streaming": "streaming",
    "realtime": "real-time work",
    "live": "live work",
    "notebook": "a notebook",
}

#: Keys that only live work asks for -> what they declare.
LIVE_KEYS = {
    "port": "a port to expose",
    "ports": "ports to expose",
    "latency": "a latency requirement",
    "interactive": "an interactive session",
    "expose": "an endpoint to expose",
}


def live_kind(kind: object) -> str | None:
    """What a live ``work.kind`` means (``"a service"``), or None for any other value."""
    if not isinstance(kind, str):
        return None
    norm = kind.strip().lower().replace("-", "").replace("_", "").replace(" ", "")
    return _LIVE_KINDS.get(norm)


def live_message(what: str) -> str:
    """The start of a live-work refusal: ``live work is refused: WHAT``."""
    return f"live work is refused: {what}"


def find_live_keys(data: object, loc: tuple = ()) -> list[tuple[tuple, str, Any]]:
    """Every live-work key anywhere inside ``data``.

    Returns ``(loc, key, value)`` tuples, ``loc`` ending with the key.
    """
    found: list[tuple[tuple, str, Any]] = []
    if isinstance(data, Mapping):
        for key, value in data.items():
            if isinstance(key, str) and key.lower() in LIVE_KEYS:
                found.append(((*loc, key), key, value))
            else:
                found.extend(find_live_keys(value, (*loc, key)))
    elif isinstance(data, (list, tuple)):
        for index, item in enumerate(data):
            found.extend(find_live_keys(item, (*loc, index)))
    return found


def got_key(key: str, value: object) -> str:
    """``port: 8080`` style text for a live key's ``(got ...)``."""
    return f"{key}: {short_repr(value, 40)}"
