"""Show the work's ``ctx.progress()`` reports: a rich progress bar on an
interactive terminal, log lines otherwise, and a Prefect progress artifact
in the UI (written from a background thread, so a slow Prefect API never
holds up the supervisor)."""

from __future__ import annotations

import contextvars
import json
import sys
import threading
import time
from pathlib import Path

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger

ARTIFACT_EVERY_S = 2.0  # seconds between progress artifact updates
LOG_EVERY_S = 5.0  # seconds between progress log lines


class ProgressReporter:
    """Polls the progress file the work writes (JSON ``{"done", "total",
    "metrics"}``) and shows changes.  Never raises: progress display must not
    stop a run."""

    def __init__(self, job: str, path: Path):
        self.job = job
        self.path = path
        self._mtime = 0.0
        self._artifact_id = None
        self._artifact_at = 0.0
        self._log_at = 0.0
        self._logged: str | None = None  # the last progress line logged
        self._bar = None
        self._task_id = None
        self.last: dict | None = None
        self._pending: tuple[float, str] | None = None  # newest (percent, description) to publish
        self._wake = threading.Event()
        # run in a copy of this task's context, so the artifact is attached to the run task
        threading.Thread(target=contextvars.copy_context().run, args=(self._publish_loop,), name="e31-progress",
                         daemon=True).start()

    def _publish_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, None
            if pending is None:
                continue
            percent, description = pending
            try:
                if self._artifact_id is None:
                    self._artifact_id = create_progress_artifact(percent, key="progress", description=description)
                else:
                    update_progress_artifact(self._artifact_id, percent, description=description)
            except Exception:
                pass

    def poll(self, final: bool = False) -> None:
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            return
        if mtime == self._mtime and not final:
            return
        self._mtime = mtime
        try:
            record = json.loads(self.path.read_text())
            self._show(record, final)
        except Exception:
            return

    def _show(self, record: dict, final: bool) -> None:
        self.last = record
        done, total = record.get("done") or 0, record.get("total")
        metrics = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in (record.get("metrics") or {}).items())
        percent = 100.0 * done / total if total else None
        now = time.monotonic()
        if sys.stderr.isatty():
            self._show_bar(done, total, metrics, final)
        elif final or now - self._log_at >= LOG_EVERY_S:
            self._log_at = now
            of = f"/{total:g}" if total else ""
            line = f"progress {done:g}{of} {metrics}".rstrip()
            if line != self._logged:  # the final poll of a report already logged adds nothing
                self._logged = line
                get_run_logger().info("%s", line)
        if percent is not None and (final or now - self._artifact_at >= ARTIFACT_EVERY_S):
            self._artifact_at = now
            self._pending = (percent, f"{self.job}: {done:g}/{total:g} {metrics}")
            self._wake.set()

    def _show_bar(self, done, total, metrics: str, final: bool) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        if self._bar is None:
            self._bar = Progress(
                TextColumn("[bold]run[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("{task.fields[metrics]}"), transient=False,
            )
            self._bar.start()
            self._task_id = self._bar.add_task(self.job, total=total, metrics=metrics)
        self._bar.update(self._task_id, completed=done, total=total, metrics=metrics)
        if final:
            self._bar.stop()
