"""Why an input could not be listed or copied, in one line with the fix: a missing or refused URL, a
host that does not resolve or answer, an HTTP status a retry will not change.  Reads what fsspec and
``aiohttp`` raise (the error, or the one it was raised from)."""

from __future__ import annotations

import socket


def not_found(exc: FileNotFoundError) -> str:
    """Why a URL counts as missing.  fsspec's HTTP filesystem raises
    ``FileNotFoundError`` for any failed request, chained to the response
    error: a refusal (401, 403) or another status is said as such."""
    status = getattr(exc.__cause__, "status", None)
    if isinstance(status, int) and status != 404:
        return http_answer(status, getattr(exc.__cause__, "message", ""))
    return unreachable(exc) or "not found"


#: getaddrinfo's answers for a name that does not exist (as opposed to a resolver that failed).
_NO_SUCH_NAME = frozenset(code for code in (getattr(socket, "EAI_NONAME", None), getattr(socket, "EAI_NODATA", None))
                          if code is not None)


def unreachable(exc: BaseException) -> str | None:
    """Why a request never reached a server -- its host name does not
    resolve, or the host did not answer (connection refused, unreachable,
    timed out) -- with the fix; None for any other error.  Reads an
    ``aiohttp`` connector error (``host``, ``port``, ``os_error``), raised
    or chained (fsspec's HTTP filesystem raises ``FileNotFoundError`` from
    it for any failed request)."""
    for err in (exc, exc.__cause__, exc.__context__):
        host, os_error = getattr(err, "host", None), getattr(err, "os_error", None)
        if not isinstance(host, str) or not isinstance(os_error, OSError):
            continue
        port = getattr(err, "port", None)
        where = f"{host}:{port}" if port else host
        if isinstance(os_error, socket.gaierror):
            if os_error.errno in _NO_SUCH_NAME:
                return f"the host {host} does not resolve (no such name); check the host name in the URL"
            return (f"the host {host} could not be resolved ({os_error.strerror or os_error.errno}); check this "
                    "machine's DNS and the host name in the URL")
        if isinstance(os_error, ConnectionRefusedError):
            return (f"the host {where} did not answer (connection refused); check that its server is running "
                    "and the URL's host and port")
        return (f"the host {where} did not answer ({os_error.strerror or type(os_error).__name__}); check that it "
                "is up and reachable from this machine, and the URL's host and port")
    return None


def http_answer(status: int, reason: str | None) -> str:
    """An HTTP ``status`` and its ``reason`` in words; a refusal (401, 403) with where to fix it."""
    if status in (401, 403):
        return (f"the server refused access (HTTP {status} {reason or ''}".rstrip() +
                "); check the credentials in storage_options (headers) or the URL's signature")
    return f"the server answered HTTP {status} {reason or ''}".rstrip()


#: HTTP statuses of a download that retrying will not change.
FINAL_STATUSES = frozenset({400, 401, 403, 404, 405, 410, 451})


def final_refusal(exc: BaseException) -> str | None:
    """Why a copy failed for good -- the file vanished after the preflight,
    or the server refused it with a status in :data:`FINAL_STATUSES` (an
    ``aiohttp`` response error, possibly chained) -- or None for errors a
    retry may cure."""
    for err in (exc, exc.__cause__):
        status = getattr(err, "status", None)
        if isinstance(status, int) and status in FINAL_STATUSES:
            return "gone since the preflight" if status in (404, 410) else http_answer(status, getattr(err, "message", ""))
    if isinstance(exc, FileNotFoundError):
        return "gone since the preflight"
    return None
