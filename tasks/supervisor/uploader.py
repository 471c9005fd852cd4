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

A sharded checkpoint (:mod:`e31.tasks.work.sharded`) is uploaded as this
rank's part; on the lead the step becomes durable only once every rank's part
has landed, which :meth:`Uploader.poll` checks every :data:`SEAL_EVERY_S` (in a
thread: the store is never read in the supervisor's loop) and
:meth:`Uploader.finish` waits for at most :data:`SEAL_WAIT_S`.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

from e31.tasks.checkpoint import DurableCheckpoint, checkpoint_task, latest_durable, seal, upload
from e31.tasks.work.local_checkpoints import commit_pending, committed

#: Seconds between the lead's checks that every rank's part of its newest sharded checkpoint has landed.
SEAL_EVERY_S = 1.0
#: Seconds the lead waits at the run's end for the other ranks' parts of its last sharded checkpoint.
SEAL_WAIT_S = 60.0


def _inner(future: Any) -> Future:
    """The ``concurrent.futures.Future`` behind a Prefect future (or itself)."""
    return getattr(future, "wrapped_future", future)


class Uploader:
    """Uploads checkpoints from ``local_root`` to ``durable_root`` keeping
    ``keep`` of them on both sides.  ``api_alive``: whether the Prefect API
    answers now (never blocks); without it the API is taken to answer.
    ``on_durable()``: called (it must not block) as each checkpoint becomes
    durable.  ``seals``: this is the lead (rank 0), which writes the marker of
    a sharded checkpoint once every rank's part is there; another rank's
    uploader (a gang's member) only publishes its parts."""

    def __init__(self, local_root: Path, durable_root: str, keep: int, work_sha256: str | None = None,
                 run_id: str | None = None, api_alive: Callable[[], bool] = lambda: True,
                 on_durable: Callable[[], None] | None = None, seals: bool = True):
        self.root, self.durable_root, self.keep = Path(local_root), durable_root, keep
        self.seals = seals
        self.unsealed: int | None = None  # the newest step whose part is published and not yet whole
        self._seal_future: Future | None = None
        self._next_seal = 0.0
        self._sealer: ThreadPoolExecutor | None = None
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
        next one (as a task; in a plain thread while the API is down); on the
        lead, check whether its newest sharded checkpoint is whole."""
        self._commit()
        self._seal_poll()
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

    def _seal_poll(self) -> None:
        """Collect a finished check of the newest unsealed step; start the next one when due."""
        if self._seal_future is not None:
            if not self._seal_future.done():
                return
            future, self._seal_future = self._seal_future, None
            try:
                sealed = future.result()
            except Exception as exc:  # the store away for a moment: checked again
                sealed = None
                self.notes.append(f"checking the parts of step {self.unsealed}: {type(exc).__name__}")
            if sealed is not None:
                self._record(sealed)
        if self.unsealed is None or time.monotonic() < self._next_seal:
            return
        self._next_seal = time.monotonic() + SEAL_EVERY_S
        self._sealer = self._sealer or ThreadPoolExecutor(1, thread_name_prefix="e31-seal")
        self._seal_future = self._sealer.submit(seal, self.durable_root, self.unsealed, self.keep,
                                                self.work_sha256, self.run_id)

    def _seal_wait(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s`` seconds) for the newest unsealed step to become whole; said in
        :attr:`failures` when it does not (the run resumes from the newest whole checkpoint)."""
        deadline = time.monotonic() + timeout_s
        if self._seal_future is not None:
            wait([self._seal_future], timeout=timeout_s)
            self._next_seal = 0.0
            self._seal_poll()
        while self.unsealed is not None:
            step = self.unsealed
            try:
                sealed = seal(self.durable_root, step, self.keep, self.work_sha256, self.run_id)
            except Exception:
                sealed = None
            if sealed is not None:
                self._record(sealed)
                return
            if time.monotonic() > deadline:
                self.failures.append(f"sharded checkpoint of step {step}: not every rank's part reached the "
                                     f"checkpoint URL within {timeout_s:g} s; it does not count (the newest "
                                     "whole one does)")
                self.unsealed = None
                return
            time.sleep(0.5)

    def _record(self, done: DurableCheckpoint) -> None:
        if not done.whole:  # one rank's part, published
            if self.seals:
                self.unsealed = max(done.step, self.unsealed or 0)
                self._next_seal = 0.0
            else:
                self._prune_local(done.step)
            return
        if self.unsealed is not None and self.unsealed <= done.step:
            self.unsealed = None
        self.done.append(done)
        self.durable_at = time.time()
        if self.on_durable is not None:
            self.on_durable()
        self._prune_local(done.step)

    def _prune_local(self, step: int) -> None:
        local = [c for c in committed(self.root) if c.step <= step]
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
        if self.unsealed is not None:
            self._seal_wait(min(timeout_s, SEAL_WAIT_S))
        for pool in (self._threads, self._sealer):
            if pool is not None:
                pool.shutdown(wait=False)
        if self.done:
            return self.done[-1]
        try:
            return latest_durable(self.durable_root)
        except Exception as exc:  # the store is unreachable: the return step reports it and keeps the output
            self.failures.append(f"cannot list durable checkpoints: {type(exc).__name__}")
            return None
