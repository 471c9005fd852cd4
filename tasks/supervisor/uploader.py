"""Make the work's local checkpoints durable while it keeps working.

The supervisor calls :meth:`Uploader.poll` in its loop: the newest committed
local checkpoint is handed to the ``checkpoint`` task (one upload in flight;
intermediate checkpoints are skipped when the store is slower than the
work, since only the newest is needed to resume).  Once a cancel is seen,
Prefect starts no new task in the flow run, so :meth:`finish` can upload
inline instead.

A checkpoint task needs the Prefect API to start.  When the API stops
answering (``api_alive()`` false) the uploads go on in a plain thread of
this process, so the job's checkpoints stay durable whatever happens to the
API; a task stuck waiting for the API is abandoned and its step uploaded
again.  A checkpoint task that fails may have failed on the API (creating
its task run, taking its concurrency slots, setting its state) rather than
on the store, so its step is uploaded once more in this process; only a
failure of that upload is a failure of the job's checkpoints.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

from e31.tasks.checkpoint import DurableCheckpoint, checkpoint_task, latest_durable, upload
from e31.tasks.work.local_checkpoints import commit_pending, committed


def _inner(future: Any) -> Future:
    """The ``concurrent.futures.Future`` behind a Prefect future (or itself)."""
    return getattr(future, "wrapped_future", future)


class Uploader:
    """Uploads checkpoints from ``local_root`` to ``durable_root`` keeping
    ``keep`` of them on both sides.  ``api_alive``: whether the Prefect API
    answers now (never blocks); without it the API is taken to answer.
    ``on_durable()``: called (it must not block) as each checkpoint becomes
    durable."""

    def __init__(self, local_root: Path, durable_root: str, keep: int, work_sha256: str | None = None,
                 run_id: str | None = None, api_alive: Callable[[], bool] = lambda: True,
                 on_durable: Callable[[], None] | None = None):
        self.root, self.durable_root, self.keep = Path(local_root), durable_root, keep
        self.on_durable = on_durable  # told as each checkpoint becomes durable (never blocks)
        self.durable_at: float | None = None  # when the newest checkpoint became durable (Unix seconds)
        self.work_sha256, self.run_id = work_sha256, run_id
        self.api_alive = api_alive
        self.done: list[DurableCheckpoint] = []
        self.failures: list[str] = []
        self.notes: list[str] = []  # what went otherwise than planned but did not cost a checkpoint (for the log)
        self._future: Any = None
        self._future_step: int | None = None
        self._future_is_task = False
        self._submitted: set[int] = set()
        self._retried: set[int] = set()  # steps whose task failed: uploaded again in this process
        self._threads: ThreadPoolExecutor | None = None

    def poll(self) -> None:
        """Commit what the work wrote, collect a finished upload and start the
        next one (as a task; in a plain thread while the API is down)."""
        self._commit()
        if self._future is not None:
            if not _inner(self._future).done():  # local: never waits on the Prefect API
                if self._future_is_task and not self.api_alive():
                    self._abandon()  # a task that cannot start without the API: upload it here instead
                else:
                    return
            else:
                self._collect()
        newest = committed(self.root)
        if newest and newest[-1].step not in self._submitted:
            self._start(newest[-1])

    def _start(self, ckpt) -> None:
        self._submitted.add(ckpt.step)
        args = (ckpt.path, self.durable_root, self.keep, self.work_sha256, self.run_id)
        if self.api_alive() and ckpt.step not in self._retried:
            self._future = checkpoint_task.with_options(task_run_name=f"checkpoint-step-{ckpt.step}").submit(*args)
            self._future_is_task = True
        else:
            self._threads = self._threads or ThreadPoolExecutor(1, thread_name_prefix="e31-checkpoint")
            self._future = self._threads.submit(upload, *args)
            self._future_is_task = False
        self._future_step = ckpt.step

    def _abandon(self) -> None:
        self.notes.append(f"checkpoint task for step {self._future_step} could not start (the Prefect API does "
                          "not answer); uploaded in this process instead")
        self._submitted.discard(self._future_step)
        self._future = None

    def _commit(self) -> None:
        """Commit what the work wrote; a checkpoint that cannot be committed
        (disk full, a refused file) is said once in :attr:`failures`."""
        problems: list[str] = []
        commit_pending(self.root, newest_only=True, problems=problems)
        for problem in problems:
            if problem not in self.failures:
                self.failures.append(problem)

    def _collect(self) -> None:
        """Take the result of the finished upload in flight.  A failed task's
        step is uploaded once more in this process (the next :meth:`poll` or
        :meth:`finish`); any other failure is kept in :attr:`failures`."""
        try:
            self._record(self._future.result())
        except Exception as exc:
            step = self._future_step
            if self._future_is_task and step not in self._retried:
                self._retried.add(step)
                self._submitted.discard(step)
                self.notes.append(f"checkpoint task for step {step} failed ({type(exc).__name__}); uploading it "
                                  "again in this process")
            else:  # the upload itself failed: keep going, report it
                self.failures.append(str(exc))
        self._future = None

    def _settle(self, timeout_s: float) -> None:
        """Wait for the upload in flight (at most ``timeout_s`` seconds),
        abandoning a task as soon as the API stops answering; a step not
        made durable is left to be uploaded again."""
        inner, deadline = _inner(self._future), time.monotonic() + timeout_s
        while not inner.done():
            if self._future_is_task and not self.api_alive():
                self._abandon()
                return
            if time.monotonic() > deadline:
                self.failures.append(f"checkpoint upload of step {self._future_step} did not finish within "
                                     f"{timeout_s:g} s; uploaded again from this process")
                self._submitted.discard(self._future_step)
                self._future = None
                return
            wait([inner], timeout=0.5)
        self._collect()

    def _record(self, done: DurableCheckpoint) -> None:
        self.done.append(done)
        self.durable_at = time.time()
        if self.on_durable is not None:
            self.on_durable()
        local = [c for c in committed(self.root) if c.step <= done.step]
        for ckpt in local[: max(0, len(local) - self.keep)]:
            shutil.rmtree(ckpt.path, ignore_errors=True)

    def finish(self, inline: bool = False, timeout_s: float = 120.0) -> DurableCheckpoint | None:
        """Wait (at most ``timeout_s`` seconds) for the upload in flight,
        upload the newest local checkpoint if it is not durable yet, and
        return the newest durable checkpoint.  ``inline``: upload in this
        thread, without starting a task (after a cancel Prefect starts none);
        also used when the API does not answer or an upload task does not
        finish in time."""
        inline = inline or not self.api_alive()
        if self._future is not None:
            if self._future_is_task and inline and not _inner(self._future).done():
                self._abandon()
            else:
                self._settle(timeout_s)
        self._commit()
        newest = committed(self.root)
        if newest and newest[-1].step not in self._submitted and not inline and newest[-1].step not in self._retried:
            self._start(newest[-1])  # a task while the API answers
            self._settle(timeout_s)  # collected; or abandoned, timed out or failed: uploaded below
        newest = committed(self.root)
        if newest and newest[-1].step not in self._submitted:
            ckpt = newest[-1]
            self._submitted.add(ckpt.step)
            try:
                self._record(upload(ckpt.path, self.durable_root, self.keep, self.work_sha256, self.run_id))
            except Exception as exc:
                self.failures.append(str(exc))
        if self._threads is not None:
            self._threads.shutdown(wait=False)
        if self.done:
            return self.done[-1]
        try:
            return latest_durable(self.durable_root)
        except Exception as exc:  # the store is unreachable: the return step reports it and keeps the output
            self.failures.append(f"cannot list durable checkpoints: {type(exc).__name__}")
            return None
