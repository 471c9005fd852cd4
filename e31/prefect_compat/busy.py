"""Quick retries of the Prefect API's ``503 Service Unavailable`` for E31's
own clients (the scheduler's, the worker's, ``e31 submit``'s).

A Prefect server on SQLite answers 503 when a write request's transaction
meets another writer (``SQLITE_BUSY``: Prefect 3.9.1's
``is_client_retryable_exception`` in ``prefect/server/api/server.py``).
Some routes read before they write in one deferred transaction
(``PATCH /flow_runs/{id}`` with ``job_variables`` reads the run and its
deployment and validates the variables first; ``PATCH
/flow_runs/{id}/labels``): SQLite cannot upgrade such a transaction while
another connection writes and fails it at once, without waiting for its
busy timeout.  Nothing was written, and the same request sent again a few
milliseconds later nearly always succeeds.

Prefect's client retries a 503 after ``2 ** attempt`` seconds (2, 4, 8 s;
``prefect/client/base.py``), which is right for a server shedding load but
made each such write of the scheduler's cost 2-14 s: measured with
``tests/benchmarks/bench_queue.py`` (45 jobs, 3 nodes), 38 of the
scheduler's 125 job-variable writes and 14 of the workers' 47 label writes
were answered 503.  :func:`retry_busy_quickly` puts a transport in front
of a client's own that sends a request answered 503 again after
:data:`DELAYS_S` (with jitter) before handing the last answer to Prefect's
retries, which stay as they are.  Only the server's own answer for a busy
database is resent so (not a 503 with ``Retry-After``, nor a proxy's), not
for the writes nothing waits for (:data:`UNHURRIED`), and at most

Measured on Prefect 3.9.1.  Upstream offers only the back-off's settings
(``PREFECT_CLIENT_MAX_RETRIES``, ``PREFECT_CLIENT_RETRY_JITTER_FACTOR``,
``PREFECT_CLIENT_RETRY_EXTRA_CODES``): the wait stays ``2 ** attempt``
seconds, and no setting resends a busy database's 503 sooner.  The
transports are reached through Prefect's private ``client._client`` and
httpx's ``_transport``/``_mounts`` (guarded by ``tests/test_prefect_privates.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from typing import Any

import httpx

#: Seconds before each quick resend of a request answered 503 (times a jitter of 0.5-1.5): 2.3 s in all at most,
#: about what Prefect's first retry waits.  With five resends, 3 of the scheduler's 139 busy writes in a
#: bench_queue run still fell through to Prefect's retries.
DELAYS_S = (0.02, 0.05, 0.1, 0.2, 0.3, 0.3, 0.3, 0.3)

_log = logging.getLogger("e31.api")


#: The body of the Prefect server's 503 for a retryable database error
#: (``custom_internal_exception_handler`` in ``prefect/server/api/server.py``).
BUSY_BODY = {"exception_message": "Service Unavailable"}
#: Routes (path endings) whose 503s are left to Prefect's own back-off: writes nothing waits for.  A worker's
#: labels of a run (``PATCH /flow_runs/{id}/labels``, written beside the run's start) met a busy database at
#: nearly every send under load: 5.8 sends per job in a 150-job bench_queue run with quick resends.
UNHURRIED = ("/labels",)
#: Quick resends one client makes at most per :data:`BUDGET_WINDOW_S` seconds: beyond them a 503 goes to
#: Prefect's own back-off at once, so a server that keeps answering 503 is not sent more requests than it was.
BUDGET = 20
BUDGET_WINDOW_S = 10.0


class _Busy:
    """What the quick retries of one client did: ``resent`` requests sent
    again after a 503, ``recovered`` of them answered otherwise in the end."""

    def __init__(self, wrapped: Any, delays: tuple[float, ...]) -> None:
        self.wrapped, self.delays = wrapped, tuple(delays)
        self.resent = self.recovered = 0
        self._recent: list[float] = []  # time.monotonic() of the quick resends within the budget window

    @staticmethod
    def busy(response: httpx.Response) -> bool:
        """Whether ``response`` (read) is the Prefect server's own 503 for a
        busy database: no ``Retry-After`` (a server or proxy shedding load
        asks for a wait: Prefect's retries honour it) and Prefect's body."""
        if response.status_code != 503 or "retry-after" in response.headers:
            return False
        try:
            return json.loads(response.content) == BUSY_BODY
        except ValueError:
            return False

    def _again(self, request: httpx.Request, attempt: int) -> float | None:
        """Seconds to wait before sending ``request`` again after its
        ``attempt``-th busy 503 (counted from 0), or None when the quick
        retries are spent (for this request, or the client's budget)."""
        now = time.monotonic()
        self._recent = [t for t in self._recent if now - t < BUDGET_WINDOW_S]
        if attempt >= len(self.delays) or len(self._recent) >= BUDGET or request.url.path.endswith(UNHURRIED):
            return None
        self._recent.append(now)
        self.resent += 1
        _log.debug("%s %s answered 503 (the database was busy); sending it again", request.method, request.url.path)
        return self.delays[attempt] * random.uniform(0.5, 1.5)


class BusyRetryTransport(_Busy, httpx.BaseTransport):
    """A synchronous httpx transport that sends a request again after a 503
    (see the module docstring); ``wrapped``: the transport that sends it."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        attempt = 0
        while True:
            response = self.wrapped.handle_request(request)
            if response.status_code != 503:
                self.recovered += attempt > 0
                return response
            response.read()
            wait = self._again(request, attempt) if self.busy(response) else None
            if wait is None:
                return response
            response.close()
            time.sleep(wait)
            attempt += 1

    def close(self) -> None:
        self.wrapped.close()


class AsyncBusyRetryTransport(_Busy, httpx.AsyncBaseTransport):
    """The asynchronous :class:`BusyRetryTransport`."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        attempt = 0
        while True:
            response = await self.wrapped.handle_async_request(request)
            if response.status_code != 503:
                self.recovered += attempt > 0
                return response
            await response.aread()
            wait = self._again(request, attempt) if self.busy(response) else None
            if wait is None:
                return response
            await response.aclose()
            await asyncio.sleep(wait)
            attempt += 1

    async def aclose(self) -> None:
        await self.wrapped.aclose()


def retry_busy_quickly(client: Any, delays: tuple[float, ...] = DELAYS_S) -> Any:
    """Put the quick retries in front of the transports of ``client`` (a
    Prefect ``PrefectClient`` or ``SyncPrefectClient``, before or after it is
    entered), in place, and return it.  The transports Prefect built (TLS,
    proxies, connection retries) still send every request.  A client whose
    httpx client is not where Prefect 3.9 keeps it (``client._client``) is
    returned unchanged."""
    http = getattr(client, "_client", None)
    if not isinstance(http, (httpx.Client, httpx.AsyncClient)):
        return client
    wrap = BusyRetryTransport if isinstance(http, httpx.Client) else AsyncBusyRetryTransport
    transport = getattr(http, "_transport", None)
    if transport is not None and not isinstance(transport, _Busy):
        http._transport = wrap(transport, delays)
    mounts = getattr(http, "_mounts", None)
    if isinstance(mounts, dict):
        for pattern, mounted in list(mounts.items()):
            if mounted is not None and not isinstance(mounted, _Busy):
                mounts[pattern] = wrap(mounted, delays)
    return client


def busy_retries(client: Any) -> tuple[int, int]:
    """``(resent, recovered)`` counted by the quick retries of ``client``
    (see :class:`_Busy`); ``(0, 0)`` without them."""
    transport = getattr(getattr(client, "_client", None), "_transport", None)
    return (transport.resent, transport.recovered) if isinstance(transport, _Busy) else (0, 0)
