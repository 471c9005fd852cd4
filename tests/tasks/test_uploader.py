"""The supervisor's uploader when a checkpoint task fails: a task can fail on
the Prefect API (its concurrency slots, its task run) before any byte moves,
so the step is uploaded once more in this process; only a failure of that
upload is a failure of the job's checkpoints.  Found in CI: a server killed
mid-job left ``checkpoint upload did not finish within 120 s`` in a completed
manifest whose checkpoints were all durable."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch

from e31.tasks.checkpoint import latest_durable
from e31.tasks.supervisor.uploader import Uploader
from e31.tasks.work.local_checkpoints import save_state


def _failed_task(uploader: Uploader, step: int, exc: Exception) -> None:
    """Put a checkpoint task for ``step`` that ended with ``exc`` in flight."""
    future: Future = Future()
    future.set_exception(exc)
    uploader._future, uploader._future_step, uploader._future_is_task = future, step, True
    uploader._submitted.add(step)


def test_a_task_that_failed_on_the_api_is_uploaded_again_here(tmp_path: Path):
    local, durable = tmp_path / "local", tmp_path / "durable"
    save_state(local, {"w": torch.arange(4)}, step=3)
    uploader = Uploader(local, str(durable), keep=2)
    _failed_task(uploader, 3, RuntimeError("Unable to acquire concurrency slots on ['tag:e31']"))
    done = uploader.finish(inline=True)
    assert (done.step, uploader.failures) == (3, [])
    assert uploader.notes == ["checkpoint task for step 3 failed (RuntimeError); uploading it again in this process"]
    assert latest_durable(str(durable)).step == 3
    assert sorted(p.name for p in (durable / "step-3").iterdir()) == ["COMMITTED", "state.pt"]


def test_a_second_failure_is_a_failure(tmp_path: Path):
    local = tmp_path / "local"
    save_state(local, {"w": torch.arange(4)}, step=5)
    (tmp_path / "afile").write_text("x")  # the durable root is a file: every upload fails
    uploader = Uploader(local, str(tmp_path / "afile"), keep=2)
    _failed_task(uploader, 5, RuntimeError("task failed"))
    assert uploader.finish(inline=True) is None
    assert uploader.failures == [f"[Errno 20] Not a directory: '{tmp_path}/afile/step-5'"]  # the upload here
    assert uploader.notes == ["checkpoint task for step 5 failed (RuntimeError); uploading it again in this process"]
