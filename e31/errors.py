"""E31's one error base.

Every error E31 raises on purpose -- a refusal or a failure it can explain in
one line -- is an :class:`E31Error`, mixed with the builtin exception that fits
(``ValueError`` for bad input, ``RuntimeError`` for a failure while running,
``FileNotFoundError`` ...), so ``except E31Error`` catches exactly what needs no
traceback, and ``except ValueError`` still works for callers who expect it.

Standard library only: every layer (specs, tasks, flows, deployments) imports it.
"""

from __future__ import annotations

#: Exit codes of the ``e31`` command line.
EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_PARTIAL = 0, 1, 2, 3


class E31Error(Exception):
    """An error E31 explains in one line (its ``str``).

    ``exit_code``: what the ``e31`` command exits with when it ends on this
    error (:data:`EXIT_FAILED`, or :data:`EXIT_INVALID` for bad input).
    ``field``: the spec field or setting at fault, when there is one
    (e.g. ``"request.gpus"``, ``"E31_TRANSFER_RETRIES"``)."""

    exit_code: int = EXIT_FAILED
    field: str | None = None


class InvalidInput(E31Error, ValueError):
    """Input E31 cannot use (a spec, a setting, a command-line value): exits 2."""

    exit_code = EXIT_INVALID
