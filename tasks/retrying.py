"""Retry conditions for Prefect tasks (``retry_condition_fn``)."""

from __future__ import annotations

from typing import Callable


def _retry_if(decide: Callable[[BaseException], bool]) -> Callable:
    """A ``retry_condition_fn`` that retries a failed task run when
    ``decide(exception)`` is true (never a run that did not raise)."""

    def condition(task, task_run, state) -> bool:
        try:
            state.result()
        except BaseException as exc:  # noqa: BLE001 - classified by decide
            return decide(exc)
        return False

    return condition


def retry_unless(*permanent: type[BaseException], but: tuple[type[BaseException], ...] = ()) -> Callable:
    """Retry a failed task run after any ``Exception`` except the
    ``permanent`` ones (a bad input, a refused destination: retrying cannot
    help), unless it is also one of ``but`` (a transient kind of a permanent
    family)."""
    return _retry_if(lambda exc: isinstance(exc, Exception) and (isinstance(exc, but) or not isinstance(exc, permanent)))


def retry_only(*transient: type[BaseException]) -> Callable:
    """Retry a failed task run only after one of the ``transient``
    exceptions (e.g. a lost child process), never after any other failure."""
    return _retry_if(lambda exc: isinstance(exc, transient))
