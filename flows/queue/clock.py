"""The queue's one clock: the Prefect server's.

Every time the queue judges is a server timestamp (a worker's
``last_heartbeat_time``, a state's ``timestamp``, a run's ``created`` and
``expected_start_time``, the scheduler's claim on its pool) set by the
server's clock, so "how long ago" is judged against the server's time:
:func:`server_now`, this machine's clock corrected by the offset measured
from the ``Date`` header of the server's answers (RFC 9110 section 6.6.1:
the origin server's time when it generated the answer, whole seconds).
Judged against this machine's clock instead, a scheduler 75 s ahead of the
server took every worker for silent past a 60 s lease and placed nothing.

A client is watched with :func:`watch` (httpx event hooks on Prefect's
httpx client: each answer is a sample, so the offset follows a clock that
is stepped or drifts); :func:`measure` adds one cheap call (``GET
/health``).  The offset is this process's, shared by its clients.  Until a
sample comes (Prefect's in-process API answers without ``Date``) the offset
is 0: the server runs on this machine's clock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from email.utils import parsedate_to_datetime
from typing import Any

#: Seconds of difference between this machine's clock and the server's beyond which the commands say so.
SKEW_WARN_S = 5.0
#: Answers the offset is taken from (the newest): a clock stepped forward is followed once they are all newer.
SAMPLES = 30
#: Seconds an answer may take and still be a sample (the offset it gives may be low by as much).
SLOW_S = 2.0
_SENT = "e31_sent"  # the request's extension holding time.time() as it was sent


class ServerClock:
    """This process's estimate of the server's clock: the offset (server
    minus local, seconds) as the largest lower bound that the last
    :data:`SAMPLES` answers give.  An answer was generated at a server time
    of at least its ``Date`` (whole seconds, and a server may write a
    ``Date`` it computed a moment before: uvicorn renews it about every
    0.1 s), before the local time of its arrival: the offset is at least
    ``Date - arrival``.  Each bound is low by the fraction of a second
    past ``Date`` plus the time the answer travelled; the largest of many,
    taken at all fractions of the second, is within the quickest answer's
    travel time of the offset."""

    def __init__(self) -> None:
        self._offsets: deque[float] = deque(maxlen=SAMPLES)
        self._lock = threading.Lock()

    def observe(self, date: str | None, sent: float, received: float) -> None:
        """Add the answer whose ``Date`` header is ``date`` (None or bad:
        ignored), for a request sent at ``sent`` and answered at ``received``
        (Unix seconds of this machine)."""
        if not date or received - sent > SLOW_S:
            return
        try:
            server = parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            return
        with self._lock:
            self._offsets.append(server - received)

    def offset(self) -> float | None:
        """Seconds the server's clock is ahead of this machine's (negative:
        behind), or None before any sample."""
        with self._lock:
            return max(self._offsets) if self._offsets else None

    def now(self) -> float:
        """The server's time now (Unix seconds), as far as it is known."""
        return time.time() + (self.offset() or 0.0)

    def reset(self) -> None:
        """Forget every sample (a test's fresh start)."""
        with self._lock:
            self._offsets.clear()


#: This process's clock of the Prefect server.
CLOCK = ServerClock()


def server_now() -> float:
    """The Prefect server's time now (Unix seconds): what every server
    timestamp is judged against."""
    return CLOCK.now()


def offset_s() -> float | None:
    """Seconds the server's clock is ahead of this machine's (None: not measured)."""
    return CLOCK.offset()


def _on_request(request: Any) -> None:
    request.extensions[_SENT] = time.time()


def _on_response(response: Any) -> None:
    received = time.time()
    CLOCK.observe(response.headers.get("date"), response.request.extensions.get(_SENT, received), received)


async def _on_request_async(request: Any) -> None:
    _on_request(request)


async def _on_response_async(response: Any) -> None:
    _on_response(response)


def watch(client: Any) -> Any:
    """Feed :data:`CLOCK` from every answer ``client`` (Prefect's
    ``PrefectClient`` or ``SyncPrefectClient``) gets: httpx event hooks on
    its httpx client (httpx's documented ``event_hooks``; async ones for
    the async client).  Once per client; returns ``client``."""
    import httpx

    http = getattr(client, "_client", None)
    if http is None or getattr(http, "_e31_clock", False):
        return client
    hooks = http.event_hooks
    if isinstance(http, httpx.AsyncClient):
        on_request, on_response = _on_request_async, _on_response_async
    else:
        on_request, on_response = _on_request, _on_response
    http.event_hooks = {"request": [*hooks.get("request", []), on_request],
                        "response": [*hooks.get("response", []), on_response]}
    http._e31_clock = True
    return client


def measure(client: Any) -> float | None:
    """:func:`watch` ``client`` (a ``SyncPrefectClient``) and ask the
    server once (``GET /health``); returns :func:`offset_s`.  A server that
    does not answer leaves the offset as it was."""
    watch(client).api_healthcheck()
    return offset_s()


async def ameasure(client: Any) -> float | None:
    """:func:`measure` for Prefect's async ``PrefectClient``."""
    await watch(client).api_healthcheck()
    return offset_s()


def skew_line(offset: float | None = None) -> str | None:
    """What ``e31 scheduler``, ``e31 worker`` and ``e31 queue`` say when this
    machine's clock differs from the server's by more than
    :data:`SKEW_WARN_S` (``offset``: seconds the server is ahead; default
    the measured one), else None."""
    offset = offset_s() if offset is None else offset
    if offset is None or abs(offset) <= SKEW_WARN_S:
        return None
    side = "ahead of" if offset < 0 else "behind"
    return (f"this machine's clock is {abs(offset):.0f} s {side} the Prefect server's; leases are judged on the "
            "server's clock; fix the clock (NTP)")


class SkewNews:
    """Says :func:`skew_line` once, and again only when it changes: the
    skew moved by :data:`SKEW_WARN_S` or more, or came back within it
    (``agreed`` line)."""

    def __init__(self) -> None:
        self.said: float | None = None  # the offset last said (None: the clocks agreed)

    def news(self) -> str | None:
        """The line to say now, or None."""
        offset = offset_s()
        if offset is None:
            return None
        if abs(offset) > SKEW_WARN_S:
            if self.said is None or abs(offset - self.said) >= SKEW_WARN_S:
                self.said = offset
                return skew_line(offset)
            return None
        if self.said is not None:
            self.said = None
            return f"this machine's clock agrees with the Prefect server's again (within {SKEW_WARN_S:g} s)"
        return None
