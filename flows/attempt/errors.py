"""What an attempt raises when its output could not come back whole."""

from __future__ import annotations

from typing import Any

from e31.errors import E31Error
from e31.flows.compile import JobPlan
from e31.specs import mask_url
from e31.tasks.manifest_model import Manifest
from e31.tasks.pending import permanent
from e31.tasks.storage import describe_error


class ReturnError(E31Error, RuntimeError):
    """The output could not be delivered to ``output.url``; it is kept in the
    job's scratch folder (``output/``, ``checkpoints/``), nothing deleted."""

    def __init__(self, plan: JobPlan, cause: BaseException):
        self.scratch = plan.scratch
        if permanent(cause):
            super().__init__(
                f"cannot return the output to {mask_url(plan.output_url)}: {describe_error(cause, plan.output_url)}; "
                f"no later try can change that (a failed manifest in partial/ says so); it is kept in "
                f"{plan.output_dir}: change the work so its files can be written there, and run the job again")
            return
        super().__init__(
            f"could not return the output to {mask_url(plan.output_url)}: {describe_error(cause, plan.output_url)}; "
            f"it is kept in {plan.output_dir} (checkpoints in {plan.checkpoint_dir}); deliver it later with: "
            f"e31 return {plan.job}"
        )


class JobFailedError(E31Error, RuntimeError):
    """The job ended ``failed``; ``manifest`` is what was written to the
    destination (the latest checkpoint and any output still came back)."""

    def __init__(self, manifest: dict[str, Any]):
        self.manifest = manifest
        m = Manifest.model_validate(manifest)
        detail = m.message or "work failed"
        tail = m.stderr_tail
        super().__init__(f"job {m.job} failed: {detail}" + (f"\n--- stderr (last lines) ---\n{tail}" if tail else ""))


class PreemptedStop(E31Error, RuntimeError):
    """The run was preempted by the queue: its output came back marked ``partial`` (reason
    ``preempted``; ``manifest``, the manifest written) and the queue runs it again.  The data of its
    ``Preempted`` state: Prefect's engine raises a cancelled state's data when the flow returns it, and an
    E31 error ends the flow process in one line (its state's message), with no traceback in its log."""

    def __init__(self, message: str, manifest: dict[str, Any]):
        self.manifest = manifest
        super().__init__(message)
