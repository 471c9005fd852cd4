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


def database_unavailable(url: str, timeout_s: float = 5.0) -> bool:
    """True when the Prefect server at ``url`` (ending in ``/api``) answers
    but says its database is not: its documented readiness check ``GET
    /ready`` answers 503 ("Database is not available") when it cannot
    connect to the database of ``PREFECT_SERVER_DATABASE_CONNECTION_URL``.
    False when it is ready, when the server does not answer, or for any other
    answer.  Sends the client's basic auth (``PREFECT_API_AUTH_STRING``)
    when one is set."""
    import base64
    import urllib.error

    from prefect.settings import PREFECT_API_AUTH_STRING

    request = urllib.request.Request(f"{url}/ready")
    auth = PREFECT_API_AUTH_STRING.value()
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return False
    except urllib.error.HTTPError as exc:
        return exc.code == 503
    except OSError:
        return False
