"""Exceptions handed to Prefect carry only masked text.

Prefect turns an exception that ends a task or flow run into its ``Failed``
state: the state's message is ``"<Type>: <str(exc)>"`` (``prefect.states.
exception_to_failed_state``), stored in the run's state history and its
database, and the exception itself is the state's data (pickled with its
``args`` when results are persisted).  A client library's exception quotes
the request's URL, a presigned URL's signature included.  So every E31 task
raises through :func:`masks_failures`, and the job flow
(:func:`e31.flows.job.run_job`) through :func:`masked_exception`: an
exception whose text, arguments or chained exceptions (``__cause__``,
``__context__``) hold a credential (what :func:`e31.tasks.storage.masking.scrub`
masks) leaves as a masked one with no chain.  (The decorator cannot wrap
the flow's function: Prefect's parameter model then resolves the string
annotations in this module, which does not define ``JobSpec``.)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, TypeVar

from e31.errors import E31Error
from e31.tasks.storage.masking import scrub

F = TypeVar("F", bound=Callable[..., Any])


class MaskedError(E31Error, RuntimeError):
    """Stands in for a foreign exception whose text held a credential: the
    message is ``"<original type>: <its text, masked>"``; ``original`` names
    the original type (``module.Class``).  Raised with no chained exception."""

    def __init__(self, message: str, original: str):
        super().__init__(message)
        self.original = original

    def __reduce__(self):  # pickled (Prefect's result persistence) with both arguments
        return type(self), (str(self), self.original)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception chained to it (causes, contexts), each once."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        todo += [err.__cause__, err.__context__]


def _leaks(err: BaseException) -> bool:
    """Whether ``err``'s text or arguments hold anything :func:`scrub` masks."""
    try:
        texts = [str(err), *(repr(a) for a in err.args)]
    except Exception:  # an exception whose __str__ fails: judged by its arguments only
        texts = [repr(a) for a in getattr(err, "args", ())]
    return any(scrub(t) != t for t in texts)


def masked_exception(exc: BaseException) -> BaseException:
    """``exc`` fit to hand to Prefect: itself when neither it nor any
    exception chained to it holds a credential; else itself with its chain
    cut (``__cause__`` and ``__context__`` None) when only the chain does,
    or when masking its string arguments cleans its text (its type is kept:
    callers and retry conditions still recognise it); else a
    :class:`MaskedError` with the masked text and no chain."""
    if not any(_leaks(err) for err in _chain(exc)):
        return exc
    if _leaks(exc):
        try:
            exc.args = tuple(scrub(a) if isinstance(a, str) else a for a in exc.args)
        except Exception:
            pass
        if _leaks(exc):
            kind = type(exc)
            try:
                text = scrub(str(exc))
            except Exception:
                text = "(its text could not be read)"
            exc = MaskedError(f"{kind.__name__}: {text}", f"{kind.__module__}.{kind.__qualname__}")
    exc.__cause__ = None
    exc.__context__ = None
    exc.__suppress_context__ = True
    return exc


def masks_failures(fn: F) -> F:
    """Decorate a task's or flow's function (under ``@task``/``@flow``) so
    that any ``Exception`` it raises leaves as :func:`masked_exception`
    makes it, raised outside the handler so that nothing is chained to it.
    ``BaseException``s that are not ``Exception``s (a cancel, a timeout, a
    Ctrl-C) pass untouched."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            failure = masked_exception(exc)
        raise failure

    return wrapper  # type: ignore[return-value]
