"""Retry conditions for Prefect tasks (``retry_condition_fn``)."""

from __future__ import annotations

from typing import Callable


def retry_unless(*permanent: type[BaseException]) -> Callable:
    """A Prefect ``retry_condition_fn`` that retries a failed task run after
    any ``Exception`` except the ``permanent`` ones (a bad input, a refused
    destination: retrying cannot help)."""

    def condition(task, task_run, state) -> bool:
        try:
            state.result()
        except permanent:
            return False
        except Exception:
            return True
        return False

    return condition


def retry_only(*transient: type[BaseException]) -> Callable:
    """A Prefect ``retry_condition_fn`` that retries a failed task run only
    after one of the ``transient`` exceptions (e.g. a lost child process),
    never after any other failure."""

    def condition(task, task_run, state) -> bool:
        try:
            state.result()
        except transient:
            return True
        except BaseException:
            return False
        return False

    return condition
