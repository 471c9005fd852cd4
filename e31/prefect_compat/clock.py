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
#: Seconds an answer may take and still be a sample (the bounds it gives are as far apart, plus 1 s).
SLOW_S = 2.0
#: Seconds of offset below which the clocks count as one: the ``Date`` header has whole seconds.
RESOLUTION_S = 1.0
_SENT = "e31_sent"  # the request's extension holding time.time() as it was sent


class ServerClock:
    """This process's estimate of the server's clock: the offset (server
    minus local, seconds) between the bounds that the last :data:`SAMPLES`
    answers give.  An answer was generated at a server time from its
    ``Date`` (whole seconds) to ``Date + 1 s``, between the local times of
    its request's sending and its arrival: the offset is at least ``Date -
    arrival`` and at most ``Date + 1 - sending``.  The largest lower bound
    and the smallest upper bound of many answers, taken at all fractions
    of the second, close in on it; the estimate is their middle.  A server
    may write a ``Date`` computed a moment before (uvicorn renews it about
    every 0.1 s; later when it is busy), which can only lower the upper
    bound: when the bounds cross, the lower one, always valid, is the
    estimate.  An offset within :data:`RESOLUTION_S` counts as none."""

    def __init__(self) -> None:
        self._bounds: deque[tuple[float, float]] = deque(maxlen=SAMPLES)
        self._lock = threading.Lock()

    def observe(self, date: str | None, sent: float, received: float) -> None:
        """Add the answer whose ``Date`` header is ``date`` (None or bad:
        ignored), for a request sent at ``sent`` and answered at ``received``
        (Unix seconds of this machine); an answer slower than
        :data:`SLOW_S` is ignored."""
        if not date or not 0 <= received - sent <= SLOW_S:
            return
        try:
            server = parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            return
        with self._lock:
            self._bounds.append((server - received, server + 1.0 - sent))

    def estimate(self) -> float | None:
        """The offset as measured (seconds the server's clock is ahead of
        this machine's; negative: behind), or None before any sample."""
        with self._lock:
            if not self._bounds:
                return None
            low, high = max(b[0] for b in self._bounds), min(b[1] for b in self._bounds)
        return low if high < low else (low + high) / 2

    def offset(self) -> float | None:
        """:meth:`estimate`, 0 when within :data:`RESOLUTION_S`."""
        found = self.estimate()
        return None if found is None else (found if abs(found) >= RESOLUTION_S else 0.0)

    def now(self) -> float:
        """The server's time now (Unix seconds), as far as it is known."""
        return time.time() + (self.offset() or 0.0)

    def reset(self) -> None:
        """Forget every sample (a test's fresh start)."""
        with self._lock:
            self._bounds.clear()


#: This process's clock of the Prefect server.
CLOCK = ServerClock()


def server_now() -> float:
    """The Prefect server's time now (Unix seconds): what every server
    timestamp is judged against."""
    return CLOCK.now()


def offset_s() -> float | None:
    """Seconds the server's clock is ahead of this machine's (None: not
    measured; 0 within :data:`RESOLUTION_S`)."""
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
