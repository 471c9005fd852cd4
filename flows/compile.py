"""Compile a job spec into the plan ``run_job`` executes: a pure function.

The plan names the inputs to stage, the per-job scratch folders, the stop
rule, the checkpoint policy and the return target.  ``e31 compile SPEC``
prints it (:func:`describe`).  Nothing here touches Prefect, the network or
the disk.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel

from e31.specs import DataInput, JobSpec, mask_url
from e31.specs.units import format_memory
from e31.tasks import settings
from e31.tasks.settings import SettingsError
from e31.specs.deadlines import next_time_of_day

RETURN_RESERVE_FLOOR_S = 30.0  # seconds kept free before a deadline for the return step (floor;
# $E31_RETURN_RESERVE_S overrides it; the run task raises it for large outputs at 50 MiB/s)


class JobPlan(BaseModel):
    """What ``run_job`` executes, derived only from the spec and settings.

    Times are seconds; ``deadline`` is timezone-aware.  ``scratch`` is the
    job's compute-local folder holding ``data/``, ``output/``,
    ``checkpoints/`` and ``run/``.
    """

    job: str
    spec_sha256: str
    work_sha256: str
    inputs: list[DataInput]
    scratch: str
    limit_s: float
    grace_s: float
    deadline: datetime | None
    deadline_kind: str = ""
    return_reserve_s: float
    device: str
    nodes: int = 1
    gpus: int
    cpus: int
    memory: int | None
    checkpoint_url: str
    checkpoint_keep: int
    checkpoint_every_s: float | None
    checkpoint_every_steps: int | None
    output_url: str
    output_files: list[str]

    @property
    def data_dir(self) -> Path:
        return Path(self.scratch) / "data"

    @property
    def output_dir(self) -> Path:
        return Path(self.scratch) / "output"

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.scratch) / "checkpoints"

    @property
    def run_dir(self) -> Path:
        return Path(self.scratch) / "run"

    def stop_at(self, run_start: float) -> tuple[float, str]:
        """Hard stop as Unix seconds for a run starting at ``run_start``, and
        its reason: the earlier of ``run_start + limit`` (``time_limit``) and
        ``deadline - return reserve`` (``deadline``)."""
        stop, reason = run_start + self.limit_s, "time_limit"
        if self.deadline is not None:
            by_deadline = self.deadline.timestamp() - self.return_reserve_s
            if by_deadline < stop:
                stop, reason = by_deadline, "deadline"
        return stop, reason


def return_reserve_s() -> float:
    """``$E31_RETURN_RESERVE_S`` (seconds >= 0), else the 30 s floor: the seconds before a
    deadline kept for returning the output.  Raises :class:`SettingsError` for a bad value."""
    text = os.environ.get("E31_RETURN_RESERVE_S")
    if text is None:
        return RETURN_RESERVE_FLOOR_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise SettingsError(f"E31_RETURN_RESERVE_S must be a number of seconds >= 0 (got {text!r})")
    return value


def default_scratch_root() -> Path:
    """``$E31_SCRATCH``, else ``$XDG_CACHE_HOME/e31/scratch``, else
    ``~/.cache/e31/scratch``."""
    if os.environ.get("E31_SCRATCH"):
        return Path(os.environ["E31_SCRATCH"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "e31" / "scratch"


def spec_sha256(spec: JobSpec) -> str:
    """sha256 of the spec's canonical JSON (sorted keys): identifies a spec."""
    text = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def work_sha256(spec: JobSpec) -> str:
    """sha256 of what determines the computation (``work`` and ``data``):
    checkpoints are resumed only by a run with the same work hash, so a
    changed limit or destination resumes, a changed ``params`` starts fresh."""
    text = json.dumps(spec.model_dump(mode="json", include={"work", "data"}), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def resolve_deadline(spec: JobSpec, start: datetime) -> tuple[datetime | None, str]:
    """The absolute deadline of a run scheduled to start at ``start``
    (timezone-aware) and how it was given: ``deadline`` as is,
    ``deadline_within`` after ``start``, ``deadline_at`` the next such wall-clock
    time at or after ``start``.  Returns ``(None, "")`` without a deadline."""
    req = spec.request
    if req.deadline_within is not None:
        return start + req.deadline_within, f"within {req.deadline_within} of the scheduled start"
    if req.deadline_at is not None:
        return next_time_of_day(req.deadline_at, start), f"{req.deadline_at}, the next after the scheduled start"
    return req.deadline, "absolute" if req.deadline else ""


def compile_plan(spec: JobSpec, scratch_root: Path | None = None, start: datetime | None = None) -> JobPlan:
    """Turn a validated :class:`specs.JobSpec` into a :class:`JobPlan` for a run
    scheduled to start at ``start`` (default: now).

    The time limit is ``request.limit``, or ``request.duration`` for a job that
    gives only its expected duration.  The default durable checkpoint
    location is ``<output.url>/checkpoints/``.  Raises :class:`SettingsError`
    for a bad ``E31_RETURN_RESERVE_S`` or tuning variable (:mod:`e31.tasks.settings`).
    """
    settings.check()
    req, out = spec.request, spec.output
    deadline, deadline_kind = resolve_deadline(spec, start or datetime.now(timezone.utc))
    limit = req.limit or req.duration
    root = Path(scratch_root) if scratch_root else default_scratch_root()
    policy = out.checkpoint
    return JobPlan(
        job=spec.name,
        spec_sha256=spec_sha256(spec),
        work_sha256=work_sha256(spec),
        inputs=list(spec.data),
        scratch=str(root / spec.name),
        limit_s=limit.total_seconds(),
        grace_s=min(req.grace.total_seconds(), limit.total_seconds()),
        deadline=deadline,
        deadline_kind=deadline_kind,
        return_reserve_s=return_reserve_s(),
        device="cuda" if req.gpus > 0 else "cpu",
        nodes=req.nodes,
        gpus=req.gpus,
        cpus=req.cpus,
        memory=req.memory,
        checkpoint_url=policy.url or out.url.rstrip("/") + "/checkpoints",
        checkpoint_keep=policy.keep,
        checkpoint_every_s=policy.every.total_seconds() if policy.every else None,
        checkpoint_every_steps=policy.every_steps,
        output_url=out.url,
        output_files=list(out.files),
    )


def describe(plan: JobPlan, now: datetime | None = None) -> str:
    """Human-readable plan for ``e31 compile`` (URLs masked)."""
    now = now or datetime.now(timezone.utc)
    start = now.timestamp()
    stop, reason = plan.stop_at(start)
    lines = [
        f"job {plan.job} (spec sha256 {plan.spec_sha256[:12]})",
        f"  stage ({len(plan.inputs)} input{'s' if len(plan.inputs) != 1 else ''}) into {plan.data_dir}",
        *[f"    {i.name}: {mask_url(i.url)}" + (f" (sha256 {i.sha256[:12]}...)" if i.sha256 else "") for i in plan.inputs],
        f"  run on {plan.device}: {plan.cpus} cpu, {plan.gpus} gpu; scratch {plan.scratch}" if plan.nodes == 1 else
        f"  run on {plan.nodes} nodes at once (a gang: all start together or none), each on {plan.device}: "
        f"{plan.cpus} cpu, {plan.gpus} gpu{'' if plan.memory is None else ', ' + format_memory(plan.memory)} "
        f"({plan.nodes * plan.cpus} cpu, {plan.nodes * plan.gpus} gpu"
        f"{'' if plan.memory is None else ', ' + format_memory(plan.nodes * plan.memory)} in all); scratch "
        f"{plan.scratch} on each",
        f"    stop after {_secs(stop - start)} ({reason}); warning {_secs(plan.grace_s)} before the hard stop",
    ]
    if plan.deadline is not None:
        lines.append(f"    deadline {plan.deadline.isoformat()} ({plan.deadline_kind}; return reserve "
                     f"{_secs(plan.return_reserve_s)})")
    every = f"every {plan.checkpoint_every_steps} steps" if plan.checkpoint_every_steps else (
        f"every {_secs(plan.checkpoint_every_s)}" if plan.checkpoint_every_s else "when the work asks"
    )
    lines += [
        f"  checkpoint {every}, keep {plan.checkpoint_keep}, durable at {mask_url(plan.checkpoint_url)}",
        f"  return {', '.join(plan.output_files)} (+ manifest.json) to {mask_url(plan.output_url)}",
    ]
    return "\n".join(lines)


def describe_markdown(spec: JobSpec, plan: JobPlan) -> str:
    """The four declarations as markdown for the flow run's page in the
    Prefect UI (URLs masked)."""
    req, work = spec.request, spec.work
    runs = f"`{work.entrypoint}`" if work.entrypoint else "`" + " ".join(mask_url(a) for a in work.command or []) + "`"
    inputs = "\n".join(f"| {d.name} | `{mask_url(d.url)}` | {d.sha256 or ''} |" for d in spec.data) or "| (none) | | |"
    deadline = req.deadline.isoformat() if req.deadline else "none"
    return (
        f"# {spec.name}\n\n"
        f"**work**: {work.kind}, runs {runs}\n\n"
        f"**data**:\n\n| name | url | sha256 |\n|---|---|---|\n{inputs}\n\n"
        f"**request**: {f'{req.nodes} nodes, each ' if req.nodes > 1 else ''}{req.gpus} gpu, {req.cpus} cpu, "
        f"memory {format_memory(req.memory) if req.memory else 'any'}, "
        f"duration {req.duration or '-'}, limit {req.limit or '-'}, deadline {deadline}, grace {req.grace}, "
        f"retries {req.retries}\n\n"
        f"**output**: {spec.output.kind} to `{mask_url(plan.output_url)}`, complete when "
        f"{', '.join(f'`{f}`' for f in plan.output_files)} exist; checkpoints at `{mask_url(plan.checkpoint_url)}`, "
        f"keep {plan.checkpoint_keep}\n"
    )


def _secs(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.2f}h"
