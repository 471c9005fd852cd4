"""Whether the Prefect API answers, asked without Prefect's client (whose
retries can take minutes when the server is gone).

Measured on Prefect 3.9.1: its client's ``api_healthcheck()`` (``GET
/health``) goes through the client's retries (``PREFECT_CLIENT_MAX_RETRIES``,
5 by default, with an exponential back-off) of timeouts, 503s and, once
the client has connected, of refused connections: a server that died
mid-run is told only after them.  Upstream offers no bounded check;
this one is a single ``urllib`` request with a timeout."""

from __future__ import annotations

import urllib.request

from e31.specs import mask_url


def api_ready(url: str, timeout_s: float = 2.0) -> bool:
    """True when the Prefect API at ``url`` (ending in ``/api``) answers its
    health check with 200 within ``timeout_s`` seconds."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


def api_answers() -> bool:
    """Whether the configured Prefect API (``PREFECT_API_URL``) answers now;
    True when none is configured (Prefect's own temporary API in-process)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    return not url or api_ready(url)


def _ready_request(url: str) -> urllib.request.Request:
    """``GET {url}/ready``, Prefect's readiness check, with the client's basic auth
    (``PREFECT_API_AUTH_STRING``, else the URL's own ``user:password@``, which
    urllib would take for a part of the host name) when one is set."""
    import base64
    from urllib.parse import unquote, urlsplit, urlunsplit

    from prefect.settings import PREFECT_API_AUTH_STRING

    parts = urlsplit(url)
    userinfo, _, host = parts.netloc.rpartition("@")
    bare = urlunsplit(parts._replace(netloc=host)) if userinfo else url
    request = urllib.request.Request(f"{bare.rstrip('/')}/ready")  # PREFECT_API_URL may end in a slash
    auth = PREFECT_API_AUTH_STRING.value() or unquote(userinfo)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    return request


#: The line for a server whose database does not answer: the connection URL itself (it may hold a password)
#: is never shown, only the setting's name.
DATABASE_DOWN = ("the Prefect server at {api} answers, but its database does not: check the database named by the "
                 "server's PREFECT_SERVER_DATABASE_CONNECTION_URL (is PostgreSQL running and reachable? pg_isready) "
                 "and retry")


#: The line for a command whose ``PREFECT_API_URL`` answers but is not the API's address (Prefect's server
#: answers 404 for a path outside its API, e.g. a URL without ``/api``).
NOT_THE_API = ("PREFECT_API_URL={api} is not a Prefect API address ({ready} answered 404): it ends in /api, "
               "e.g. http://127.0.0.1:4200/api; set PREFECT_API_URL so and retry")
#: The line for a server that refused this client's basic auth (HTTP 401: its
#: ``PREFECT_SERVER_API_AUTH_STRING``); ``state``: whether the client's string is set.  The string itself is
#: never shown.
CREDENTIALS_REFUSED = ("the Prefect server at {api} requires basic auth and PREFECT_API_AUTH_STRING {state}: set "
                       "PREFECT_API_AUTH_STRING to the user:password of the server's PREFECT_SERVER_API_AUTH_STRING")


def credentials_refused(url: str) -> str:
    """:data:`CREDENTIALS_REFUSED` for the server at ``url`` (its password, if it holds one, masked)."""
    from prefect.settings import PREFECT_API_AUTH_STRING

    state = "is set but the server refused it" if PREFECT_API_AUTH_STRING.value() else "is not set"
    return CREDENTIALS_REFUSED.format(api=mask_url(url), state=state)


#: The line for a command whose ``PREFECT_API_URL`` cannot be reached (nothing listens there, no such host).
UNREACHABLE = ("nothing answers at PREFECT_API_URL={api} ({reason}): is the Prefect server running? Start it "
               "(prefect server start) or point PREFECT_API_URL at it")


def ready_problem(url: str, timeout_s: float, starting: bool = False) -> str | None:
    """One line saying why the Prefect server at ``url`` (ending in
    ``/api``) cannot serve a command now, asked once through its documented
    readiness check ``GET /ready`` with a ``timeout_s`` seconds limit
    (Prefect's client would retry a 503 for about two minutes, and wait on
    a server that accepted the connection but never answers for as long as
    it stays so): its database does not answer (:data:`DATABASE_DOWN`), or
    it does not answer within ``timeout_s`` (frozen or overloaded).  None
    when it is ready, for any other answer, and when nothing listens there
    (Prefect's client says that at once, and the caller words it).  Sends
    the client's basic auth (``PREFECT_API_AUTH_STRING``) when one is
    set.

    ``starting``: also name the three mistakes of a command that starts (a
    worker would otherwise say it started and retry for ever): nothing
    answers at ``url`` (:data:`UNREACHABLE`), ``url`` is not the API's
    address (:data:`NOT_THE_API`), and the server refuses the client's
    basic auth (:data:`CREDENTIALS_REFUSED`).  ``url`` is shown with its
    password masked."""
    import urllib.error

    request = _ready_request(url)
    shown = mask_url(url)  # a URL with user:password@ is said without the password
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return None
    except urllib.error.HTTPError as exc:
        if exc.code == 503:
            return DATABASE_DOWN.format(api=shown)
        if exc.code == 401 and starting:
            return credentials_refused(url)
        return NOT_THE_API.format(api=shown, ready=mask_url(request.full_url)) if starting and exc.code == 404 else None
    except (TimeoutError, urllib.error.URLError) as exc:
        reason = getattr(exc, "reason", None)
        if isinstance(exc, TimeoutError) or isinstance(reason, TimeoutError):
            return (f"the Prefect server at {shown} did not answer within {timeout_s:g} s (E31_API_TIMEOUT_S): it is "
                    "frozen or overloaded; check its process and its database, then retry")
        if starting and isinstance(reason, OSError):
            return UNREACHABLE.format(api=shown, reason=getattr(reason, "strerror", None) or type(reason).__name__)
        return None
    except OSError as exc:
        return UNREACHABLE.format(api=shown, reason=exc.strerror or type(exc).__name__) if starting else None
