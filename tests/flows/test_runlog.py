"""The engine's closing record for a run that ends with an explained
failure, or that was cancelled as its flow process started (offline)."""

from __future__ import annotations

import logging
import sys

from e31.prefect_compat.runlog import CANCELLED_BEFORE_START, ExplainedFailureFilter


def _record(exc: BaseException, message: str = "Engine execution exited with unexpected exception") -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord("prefect.engine", logging.ERROR, __file__, 1, message, (), info)


def test_a_run_cancelled_as_its_flow_process_starts_ends_in_one_line_not_a_traceback():
    """A job cancelled while its flow process starts must not log the
    engine's ~40-line traceback ending in ``UnfinishedRun: Run is in
    CANCELLING state`` to the worker's output and the run's log.  The
    record is one INFO line with no traceback; an E31 error's is dropped
    (run_job said it already); any other failure keeps its traceback."""
    from prefect.exceptions import UnfinishedRun

    from e31.errors import E31Error

    quiet = ExplainedFailureFilter()
    cancelled = _record(UnfinishedRun("Run is in CANCELLING state, its result is not available."))
    assert quiet.filter(cancelled) is True
    assert (cancelled.getMessage(), cancelled.levelname, cancelled.exc_info) == (CANCELLED_BEFORE_START, "INFO", None)
    assert logging.Formatter().format(cancelled) == "the flow run was cancelled before its flow began: nothing ran"
    assert quiet.filter(_record(E31Error("output.url: not writable"))) is False
    other = _record(RuntimeError("boom"))
    assert quiet.filter(other) is True and other.levelname == "ERROR" and other.exc_info[1].args == ("boom",)
    unfinished = _record(UnfinishedRun("Run is in PENDING state, its result is not available."))
    assert quiet.filter(unfinished) is True and unfinished.exc_info is not None  # not a cancel: kept as it was
    elsewhere = _record(UnfinishedRun("Run is in CANCELLING state"), message="another line")
    assert quiet.filter(elsewhere) is True and elsewhere.exc_info is not None


def test_a_network_error_of_prefect_s_clients_is_one_line_on_the_console():
    """A server frozen for 40 s made Prefect's observers in ``e31 worker`` print four tracebacks of a
    closed event stream: one line each, with the error's name (not its text, which may quote a URL);
    any other error keeps its traceback."""
    import websockets.exceptions

    from e31.prefect_compat.runlog import QuietFormatter

    quiet = QuietFormatter(logging.Formatter("%(message)s"))
    closed = _record(websockets.exceptions.ConnectionClosedError(None, None), "Cancellation polling task failed.")
    assert quiet.format(closed) == "Cancellation polling task failed. (ConnectionClosedError)"
    other = quiet.format(_record(KeyError("x"), "something else"))
    assert other.startswith("something else\nTraceback") and other.endswith("KeyError: 'x'")
