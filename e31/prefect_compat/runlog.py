"""How a run's log looks on the console: E31's own errors, already explained
in one line, are shown without their traceback (the Prefect API's copy of
the log keeps it); Prefect's lines while its API is unreachable, and its
engine's traceback of a failure E31 explained, are cut to one line.

Measured on Prefect 3.9.1, whose log texts these filters match (``Service
%r failed to process item``, ``Unable to connect to``, ``exited with
unexpected exception``: listed in ``tests/test_prefect_privates.py``, which
fails when a Prefect release rewords them).  Upstream offers a whole
logging configuration (``PREFECT_LOGGING_SETTINGS_PATH``, a ``logging.yml``
that could name these filters), which would replace the user's own; nothing
upstream quiets a failure's traceback by exception type or rate-limits a
service's send failures."""

from __future__ import annotations

import logging

from e31.errors import E31Error

#: Modules of storage clients whose errors (an endpoint down, throttling) are
#: logged in one line on the console: the traceback says nothing more.
_STORAGE_CLIENTS = ("botocore.", "aiobotocore.", "aiohttp.", "fsspec.", "s3fs.", "gcsfs.", "adlfs.", "azure.")

#: Modules of the clients Prefect reaches its server with: their errors (a closed event stream, a timeout)
#: say only that the server is frozen or away, which one line tells.
_API_CLIENTS = ("websockets.", "httpx.", "httpcore.")


def _quiet(exc: BaseException | None) -> bool:
    from e31.tasks.outcome import ChildLost

    return exc is not None and (isinstance(exc, (E31Error, ChildLost, OSError))
                                or type(exc).__module__.startswith(_STORAGE_CLIENTS + _API_CLIENTS))


class QuietFormatter(logging.Formatter):
    """Wraps the console handler's formatter: a record carrying one of E31's
    errors, a lost child, a storage client's error or a network error of the
    Prefect API's clients is shown without its traceback."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        exc = record.exc_info[1] if record.exc_info else None
        if _quiet(exc):
            said = {}
            if type(exc).__module__.startswith(_API_CLIENTS):  # its name only: the text may quote a URL
                said = {"msg": f"{record.getMessage()} ({type(exc).__name__})", "args": None}
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None, **said})
        return self.inner.format(record)


class ApiOutageFilter(logging.Filter):
    """While the Prefect API is unreachable, Prefect's background services log
    every event and log batch they cannot send, each with the whole event
    (kilobytes a line).  On the console this says it once a minute, in one line."""

    EVERY_S = 60.0

    def __init__(self) -> None:
        super().__init__()
        self._said_at = -1e9

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage() if record.name.startswith(("prefect._internal", "prefect.events")) else ""
        if "failed to process item" not in text and "Unable to connect to" not in text:
            return True
        import time

        now = time.monotonic()
        if now - self._said_at < self.EVERY_S:
            return False
        self._said_at = now
        record.msg, record.args = "the Prefect API is unreachable: run events and logs are not being sent", ()
        record.exc_info = record.exc_text = None
        return True


#: What Prefect's engine logs, with the exception's traceback, when a flow run ends ``Failed`` with an exception
#: (``Engine execution exited with ...`` in ``run_flow``, ``prefect/flow_engine.py``; ``Execution of flow run
#: ... exited with ...`` in ``handle_engine_signals``, ``prefect/engine.py``).
ENGINE_FAILURE_LINE = "exited with unexpected exception"


#: What the engine's closing record says instead, in one line, for a run cancelled before its flow began.
CANCELLED_BEFORE_START = "the flow run was cancelled before its flow began: nothing ran"


class ExplainedFailureFilter(logging.Filter):
    """Drops the engine's closing ``... exited with unexpected exception``
    record, with its traceback, when the exception is one of E31's errors:
    ``run_job`` logged it already in one line that names the field and the
    fix, and the run's state message says it.  When the exception is
    Prefect's ``UnfinishedRun`` of a run in ``CANCELLING`` or ``CANCELLED``
    (cancelled while its flow process started: the engine cannot begin the
    run, ~40 lines of traceback), the record becomes the one line
    :data:`CANCELLED_BEFORE_START`.  Put on the loggers Prefect's engine
    writes it to (``prefect.flow_runs``, ``prefect.engine``), so neither the
    console nor the run's log in the Prefect UI gets the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: A003 - logging's name
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        try:
            message = record.getMessage()
        except Exception:
            return True
        if ENGINE_FAILURE_LINE not in message:
            return True
        if isinstance(exc, E31Error):
            return False
        from prefect.exceptions import UnfinishedRun

        if isinstance(exc, UnfinishedRun) and ("CANCELLING" in str(exc) or "CANCELLED" in str(exc)):
            record.msg, record.args, record.exc_info, record.exc_text = CANCELLED_BEFORE_START, (), None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def drop_explained_failures() -> None:
    """Install :class:`ExplainedFailureFilter` on Prefect's engine loggers
    (idempotent)."""
    for name in ("prefect.flow_runs", "prefect.engine"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, ExplainedFailureFilter) for f in logger.filters):
            logger.addFilter(ExplainedFailureFilter())


class PrintedFilter(logging.Filter):
    """Drops from the console a record whose text ``e31 run`` printed there
    already (the attribute :data:`e31.tasks.supervisor.report.PRINTED`, e.g.
    ``resumed from step N (URL)``); the run's log in the Prefect UI keeps it."""

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: A003 - logging's name
        from e31.tasks.supervisor.report import PRINTED

        return not getattr(record, PRINTED, False)


def hide_tracebacks_on_console() -> None:
    """Install :class:`QuietFormatter`, :class:`ApiOutageFilter` and
    :class:`PrintedFilter` on Prefect's console handler(s)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    from e31.tasks.storage.masking import install_log_masking

    install_log_masking()
    outage = ApiOutageFilter()
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not isinstance(handler.formatter, QuietFormatter):
            handler.setFormatter(QuietFormatter(handler.formatter or logging.Formatter()))
            handler.addFilter(outage)
            handler.addFilter(PrintedFilter())
    for handler in logging.getLogger("prefect._internal").handlers:  # Prefect's services log here, not propagated
        if not any(isinstance(f, ApiOutageFilter) for f in handler.filters):
            handler.addFilter(outage)
