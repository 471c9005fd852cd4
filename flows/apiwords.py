"""The one line a command says when the Prefect API cannot serve it: asked first
(:func:`check_server`, for the commands in :data:`TALKS`), or after a call
failed (:func:`refused_credentials`, :func:`database_down`).  The URL is
shown with any password masked, a basic-auth string never."""

from __future__ import annotations

from e31.errors import E31Error
from e31.tasks import settings

__all__ = ["TALKS", "check_server", "database_down", "refused_credentials", "within_groups"]


def refused_credentials(exc: BaseException) -> str | None:
    """The line for a Prefect server that refused this client's credentials (HTTP 401: its
    ``PREFECT_SERVER_API_AUTH_STRING`` basic auth; also inside an exception group), naming the setting to
    fix (:func:`e31.prefect_compat.api.credentials_refused`); None for any other error.  The string itself
    is never shown."""
    from prefect.settings import PREFECT_API_URL

    from e31.prefect_compat.api import credentials_refused

    if not any(getattr(getattr(e, "response", None), "status_code", None) == 401 for e in within_groups(exc)):
        return None
    return credentials_refused(PREFECT_API_URL.value() or "")


def within_groups(exc: BaseException) -> list[BaseException]:
    """``exc``, every exception inside it when it is an exception group (a worker's task group, anyio's),
    and the exceptions each was raised from or while handling (``__cause__``, ``__context__``: a worker's
    task group ends with anyio's own error, raised while Prefect's was handled)."""
    found: list[BaseException] = []
    todo = [exc]
    while todo and len(found) < 100:
        e = todo.pop()
        if any(e is f for f in found):
            continue
        found.append(e)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return found


def database_down(exc: BaseException) -> str | None:
    """The line for a command that failed on the Prefect server's side (an HTTP 5xx, or a timeout) when
    the server's readiness check says why (:func:`e31.prefect_compat.api.ready_problem`): its database
    does not answer (naming the server's setting; the connection URL itself, which may hold a password,
    is never shown), or it does not answer within ``E31_API_TIMEOUT_S``; None otherwise."""
    from prefect.settings import PREFECT_API_URL

    from e31.prefect_compat.api import ready_problem

    status = getattr(getattr(exc, "response", None), "status_code", None) or 0
    api = PREFECT_API_URL.value()
    if not api or not (status >= 500 or "Timeout" in type(exc).__name__):
        return None
    return ready_problem(api, settings.value("E31_API_TIMEOUT_S"))


#: Commands that talk to the Prefect server first thing: it is asked once whether it can serve them
#: (:func:`check_server`).  ``e31 run`` with no ``PREFECT_API_URL`` starts a temporary one of its own.
TALKS = frozenset({"run", "deploy", "submit", "queue", "cancel", "node", "usage", "scheduler", "worker"})


def check_server() -> None:
    """Raise :class:`E31Error` with one line when the configured Prefect server
    (``PREFECT_API_URL``) cannot serve a command now: its database does not
    answer, it does not answer within ``E31_API_TIMEOUT_S`` seconds, nothing
    answers there, or the URL is not the API's
    (:func:`e31.prefect_compat.api.ready_problem`).  Without this a command
    was silent for about two minutes of Prefect's client retrying 503s, or
    waited for as long as a frozen server stayed frozen."""
    from prefect.settings import PREFECT_API_URL

    from e31.prefect_compat.api import ready_problem

    api = PREFECT_API_URL.value()
    if not api:
        return
    settings.check()
    problem = ready_problem(api, settings.value("E31_API_TIMEOUT_S"), starting=True)
    if problem is not None:
        raise E31Error(problem)
