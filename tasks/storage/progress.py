"""Progress of a data transfer (staging an input, returning an output).

Bytes and rate on a rich progress bar when stderr is a terminal (one shared
display, so concurrent stage tasks each get a line), a log line every
``LOG_EVERY_S`` seconds otherwise, and a Prefect progress artifact (key
``<label>``) updated every ``ARTIFACT_EVERY_S`` seconds from a background
thread, so a slow Prefect API never holds up a transfer.  The display
never raises: progress must not fail a transfer; only a ``stop`` event
(a cancelled flow run) ends one, through :meth:`TransferProgress.advance`.
"""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from typing import Callable

from fsspec.callbacks import Callback

ARTIFACT_EVERY_S = 2.0  # seconds between progress artifact updates
LOG_EVERY_S = 5.0  # seconds between log lines when not on a terminal

_display_lock = threading.Lock()
_display = None  # the shared rich Progress while any bar is open
_open_bars = 0


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class TransferStopped(RuntimeError):
    """A transfer ended early because its ``stop`` event was set."""


class TransferProgress:
    """Counts the bytes of one transfer of ``total`` bytes in ``files`` files.

    ``advance(n)`` is thread-safe; ``close()`` shows the final state.  Use it
    as a context manager.  ``label`` names the bar, the log lines and the
    Prefect artifact key (lowercase letters, digits and dashes); the
    progress artifact is created at the first report, :data:`ARTIFACT_EVERY_S`
    seconds in, so a transfer done sooner makes none.  With a ``stop`` event, the transfer is ended (:meth:`advance` raises) once it
    is set.  A ``gate`` is called with the bytes done so far at every
    advance: it may sleep (a paused or rate-capped transfer: the
    prefetcher's, :mod:`e31.deployments.prefetch`) or raise
    :class:`TransferStopped` to end the transfer.
    """

    def __init__(self, label: str, total: int, files: int, *, artifact: bool = True,
                 stop: threading.Event | None = None, gate: Callable[[int], None] | None = None):
        self.label, self.total, self.files = label, max(0, int(total)), files
        self._stop = stop
        self._gate = gate
        self.done = 0
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._closed = threading.Event()
        self._task = None
        artifact = artifact and _in_run()
        if sys.stderr.isatty():
            self._open_bar()
        if artifact or not sys.stderr.isatty():
            ctx = contextvars.copy_context()  # the artifact and logs belong to the calling task run
            self._thread = threading.Thread(target=ctx.run, args=(self._report_loop, artifact), daemon=True,
                                            name=f"e31-progress-{label}")
            self._thread.start()
        else:
            self._thread = None

    def __enter__(self) -> "TransferProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def advance(self, nbytes: int) -> None:
        """Add ``nbytes`` (may be negative when a retried file starts over).
        Raises :class:`TransferStopped` once ``stop`` is set, which ends the
        transfer feeding it (fsspec calls this between chunks)."""
        if self._stop is not None and self._stop.is_set():
            raise TransferStopped("the flow run was cancelled")
        with self._lock:
            self.done += nbytes
        if self._gate is not None:
            self._gate(self.done)
        if self._task is not None:
            try:
                _display.update(self._task, completed=self.done)
            except Exception:
                pass

    def callback(self) -> Callback:
        """An fsspec callback that feeds this progress the bytes of a single
        ``get_file``/``put_file``, or of every file of a list ``get``/``put``."""
        return _FsspecBytes(self)

    def rate(self) -> float:
        """Bytes per second so far."""
        return self.done / max(1e-9, time.monotonic() - self._started)

    def close(self) -> None:
        """Stop the background reporting and show the last state once."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._close_bar()

    def _open_bar(self) -> None:
        global _display, _open_bars
        try:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            with _display_lock:
                if _display is None:
                    _display = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                                        TransferSpeedColumn(), TimeRemainingColumn(), transient=False)
                    _display.start()
                _open_bars += 1
                self._task = _display.add_task(self.label, total=self.total or None)
        except Exception:
            self._task = None

    def _close_bar(self) -> None:
        global _display, _open_bars
        if self._task is None:
            return
        with _display_lock:
            try:
                _display.update(self._task, completed=self.done)
                _open_bars -= 1
                if _open_bars == 0:
                    _display.stop()
                    _display = None
            except Exception:
                pass

    def _line(self) -> str:
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return f"{self.label}: {human_bytes(self.done)} of {human_bytes(self.total)}{pct}, {self.files} file(s), {human_bytes(self.rate())}/s"

    def _report_loop(self, artifact: bool) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        artifact_id = None
        last_log = time.monotonic()
        while True:
            closed = self._closed.wait(ARTIFACT_EVERY_S)
            percent = 100.0 * self.done / self.total if self.total else (100.0 if closed else 0.0)
            if closed and artifact_id is None:  # done before its first report: no progress to show (the
                artifact = False                # task's log line and the manifest say what moved)
            if artifact:
                try:
                    if artifact_id is None:
                        artifact_id = create_progress_artifact(min(percent, 100.0), key=self.label, description=self._line())
                    else:
                        update_progress_artifact(artifact_id, min(percent, 100.0), description=self._line())
                except Exception:
                    artifact = False  # no Prefect run context or API: logs only
            if self._task is None and not closed and time.monotonic() - last_log >= LOG_EVERY_S:
                last_log = time.monotonic()
                _log(self._line())
            if closed:
                return


def _in_run() -> bool:
    """True inside a Prefect flow or task run (artifacts need one)."""
    try:
        from prefect.context import FlowRunContext, TaskRunContext

        return bool(TaskRunContext.get() or FlowRunContext.get())
    except Exception:
        return False


def _log(line: str) -> None:
    try:
        from prefect.logging import get_run_logger

        get_run_logger().info("%s", line)
    except Exception:
        pass


class _FsspecBytes(Callback):
    """fsspec callback: bytes of a single transfer go to the progress; for a
    list transfer the parent counts files and each branched child the bytes."""

    def __init__(self, progress: TransferProgress, *, child: bool = False):
        super().__init__()
        self._progress = progress
        self._child = child
        self._single = True

    def set_size(self, size):  # the parent of a list transfer gets the file count
        self.size = size

    def relative_update(self, inc=1):
        if self._single or self._child:
            self._progress.advance(inc)

    def absolute_update(self, value):
        if self._single or self._child:
            self._progress.advance(value - (self.value or 0))
        self.value = value

    def branched(self, path_1, path_2, **kwargs):
        self._single = False  # a list transfer: this one counts files, the children count bytes
        return _FsspecBytes(self._progress, child=True)
