"""``run_job``: the one static Prefect flow every E31 job runs as.

stage (one task per input, concurrent) -> run (supervised child process,
submitting a checkpoint task per durable checkpoint) -> return (output and
manifest).  Usable from Python (``run_job(load_spec("x.yaml"))`` returns the
manifest), from the ``e31`` CLI, and as a deployment entrypoint
(``flows/job.py:run_job``).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from flows.compile import Plan, compile_plan
from flows.placement import check_fits
from flows.resume import end_attempt, prepare_scratch
from specs import JobSpec
from tasks.checkpoint import latest_durable
from tasks.context import ChildConfig
from tasks.deliver import ReturnTarget, return_task
from tasks.outcome import ChildLost, RunOutcome
from tasks.run import RunSettings, run_task
from tasks.stage import stage_task


class JobFailed(RuntimeError):
    """The job ended ``failed``; ``manifest`` is what was written to the
    destination (the latest checkpoint and any output still came back)."""

    def __init__(self, manifest: dict[str, Any]):
        self.manifest = manifest
        detail = manifest.get("message") or "work failed"
        tail = manifest.get("stderr_tail")
        super().__init__(f"job {manifest.get('job')} failed: {detail}" + (f"\n--- stderr (last lines) ---\n{tail}" if tail else ""))


def _child_config(spec: JobSpec, plan: Plan, staged: dict[str, str], code_dir: str | None) -> ChildConfig:
    return ChildConfig(
        entrypoint=spec.work.entrypoint,
        command=spec.work.command,
        params=dict(spec.work.params),
        data=staged,
        output_dir=str(plan.output_dir),
        checkpoint_dir=str(plan.checkpoint_dir),
        progress_file=str(plan.run_dir / "progress.json"),
        device=plan.device,
        cpus=plan.cpus,
        gpus=plan.gpus,
        code_dirs=[code_dir] if code_dir else [],
        checkpoint_every_s=plan.checkpoint_every_s,
        checkpoint_every_steps=plan.checkpoint_every_steps,
        supervised=True,
    )


@flow(name="e31-job", flow_run_name="{spec.name}", persist_result=False)
def run_job(spec: JobSpec, code_dir: str | None = None) -> dict[str, Any]:
    """Run one declared job to its end and return its manifest (a dict, see
    DESIGN.md §2).

    ``code_dir``: a folder put first on the work's ``sys.path`` (the CLI
    passes the spec file's folder, so work code can sit beside its spec).
    Raises ``tasks.stage.StageError`` when an input cannot be staged (nothing
    ran), :class:`flows.placement.PlacementError` when the request does not
    fit this machine, and :class:`JobFailed` when the work failed (after its
    output and latest checkpoint were returned).
    """
    plan = compile_plan(spec)
    check_fits(plan)
    resume = prepare_scratch(plan)
    run_id = str(flow_run.id) if flow_run.id else None
    started = time.monotonic()
    futures = [stage_task.with_options(task_run_name=f"stage-{item.name}").submit(item, str(plan.data_dir)) for item in plan.inputs]
    staged = {s.name: s.path for s in (f.result() for f in futures)}
    target = ReturnTarget(
        job=plan.job, run_id=run_id, output_dir=str(plan.output_dir), output_url=plan.output_url,
        declared=plan.output_files, gpus=plan.gpus, cpus=plan.cpus, spec_sha256=plan.spec_sha256,
        staging_s=time.monotonic() - started,
    )
    now = time.time()
    stop_at, stop_reason = plan.stop_at(now)
    if resume.crashed and stop_at - plan.grace_s <= now:
        # An earlier attempt died with its process and this one has no time left to run.
        outcome = RunOutcome(reason="crashed", exit_code=None, run_s=0.0, checkpoint=latest_durable(plan.checkpoint_url),
                             message=f"an earlier attempt was lost and the job can no longer run ({stop_reason} passed)")
    else:
        outcome = _run(spec, plan, staged, code_dir, target, now)
    manifest = outcome.manifest or return_task(target, outcome)
    end_attempt(plan)
    if manifest["status"] == "completed":
        # Delivered and verified: the next run of this job starts fresh.
        shutil.rmtree(plan.output_dir, ignore_errors=True)
        shutil.rmtree(plan.checkpoint_dir, ignore_errors=True)
    if manifest["status"] == "failed":
        raise JobFailed(manifest)
    return manifest


def _run(spec: JobSpec, plan: Plan, staged: dict[str, str], code_dir: str | None, target: ReturnTarget, now: float) -> RunOutcome:
    """The run task with the spec's retries; a lost child that is not retried
    any more fails the job (with its exit code and the latest checkpoint)."""
    settings = RunSettings(
        job=plan.job,
        child=_child_config(spec, plan, staged, code_dir),
        run_dir=str(plan.run_dir),
        checkpoint_url=plan.checkpoint_url,
        keep=plan.checkpoint_keep,
        grace_s=plan.grace_s,
        limit_at=now + plan.limit_s,
        deadline_at=plan.deadline.timestamp() if plan.deadline else None,
        reserve_floor_s=plan.return_reserve_s,
        target=target,
        flow_run_id=target.run_id,
    )
    state = run_task.with_options(retries=spec.request.retries, retry_delay_seconds=1)(settings, return_state=True)
    try:
        return state.result()
    except ChildLost as lost:
        lost.outcome.reason = "error"
        return lost.outcome
