"""The job's verdict and ``manifest.json`` (docs/design.md §2): pure functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from e31.tasks.manifest_model import REASONS, STATUSES, Logs, Manifest, ManifestFile, Meter, Reason, Status
from e31.tasks.meter import meter

__all__ = ["REASONS", "STATUSES", "Verdict", "build_manifest", "step_text", "verdict"]


@dataclass(frozen=True)
class Verdict:
    """``status`` (completed | partial | failed), ``reason`` and a message."""

    status: Status
    reason: Reason
    message: str = ""


def step_text(step: int | None) -> str:
    """``step 12``, or ``no checkpoint`` when a run has none (for messages)."""
    return "no checkpoint" if step is None else f"step {step}"


def verdict(reason: str, exit_code: int | None, declared: list[str], present: set[str], message: str = "") -> Verdict:
    """Decide the job's status from how the run ended.

    - ``finished`` (exit 0, no stop asked) with every declared file present:
      ``completed``; with files missing: ``failed``/``error`` naming them.
    - ``error`` (non-zero exit or crash of the work): ``failed``.
    - any stop (time limit, deadline, cancel, signal, crashed): ``partial``.
    """
    if reason == "finished":
        missing = [f for f in declared if f not in present]
        if missing:
            return Verdict("failed", "error", "work finished without writing the declared output files: " + ", ".join(missing))
        return Verdict("completed", "finished", message)
    if reason == "error":
        return Verdict("failed", "error", message or f"work exited with code {exit_code}")
    if reason == "out_of_memory":
        return Verdict("failed", "out_of_memory", message or "the work used more memory than request.memory")
    return Verdict("partial", reason, message)


def build_manifest(
    *,
    job: str,
    run_id: str | None,
    verdict: Verdict,
    exit_code: int | None,
    step: int | None,
    files: list[dict[str, Any]],
    checkpoint: str | None,
    timings: dict[str, float],
    gpus: int,
    cpus: int,
    spec_sha256: str,
    finished_at: str,
    stderr_tail: str = "",
    stop_requested_at: float | None = None,
    stdout_tail: str = "",
    output_lines_dropped: int = 0,
    folder: str = ".",
    stale: list[str] | None = None,
    peak_memory: int = 0,
    staged_before_allocation: bool | None = None,
    attempt: str | None = None,
    work_started_at: float | None = None,
    released_at: float = 0.0,
    resumed_from_step: int | None = None,
    preemptions: int = 0,
    lost_s: float = 0.0,
    tenant: str | None = None,
) -> dict[str, Any]:
    """The manifest as a JSON-ready dict: :meth:`Manifest.to_json_dict` of the
    :class:`e31.tasks.manifest_model.Manifest` built here (raises
    ``pydantic.ValidationError`` when a value does not fit its field).

    ``files``: ``[{"path", "bytes", "sha256"}]`` relative to the output URL.
    ``timings`` in seconds (``staging_s``, ``run_s``, ``return_s``; and the
    run's phases ``child_start_s``, ``work_s``, ``settle_s`` when known;
    ``handover_staging_s`` and ``handover_wait_s`` for a run handed over
    behind another on its node: its staging, made while that run still held
    the node (not metered), and the seconds it then waited for that run to
    end).
    ``stop_requested_at``: Unix seconds of the stop warning (None: no stop).
    ``logs``: the work's last stdout and stderr lines (masked) and how many
    lines were not forwarded to the run's log.  ``folder``: where the files
    are, relative to ``output.url`` (``.`` for a completed run, ``partial``
    for any other); ``stale``: other files found beside the manifest that
    no E31 run of the job wrote (left in place, not part of the output).
    ``attempt``: a token of the flow process that made this attempt of the
    run (see :class:`e31.tasks.deliver.ReturnTarget`).
    ``staged_before_allocation``: True when every input was found staged
    and unchanged at the run's start (copied ahead by the node's prefetcher,
    ``timings.prefetch_s``, or by an earlier run, or by the run itself
    while the run ahead of it still held the node), so nothing was copied
    while the job held its resources; False when some input was copied in
    the run; None when the job reads no data.  ``meter``: from
    ``work_started_at`` to ``released_at`` (Unix seconds), see
    :func:`e31.tasks.meter.meter`.  ``resumed_from_step``: the checkpoint
    step the run's work resumed from (None: a fresh start).  ``preemptions``
    and ``lost_s``: how many times the queue preempted the run so far and
    the seconds of work those preemptions threw away.  ``tenant``: the pool's
    tenant the run is for (None outside a queue).
    """
    return Manifest(
        job=job,
        run_id=run_id,
        attempt=attempt,
        tenant=tenant,
        status=verdict.status,
        reason=verdict.reason,
        message=verdict.message,
        exit_code=exit_code,
        step=step,
        resumed_from_step=resumed_from_step,
        preemptions=preemptions,
        lost_s=round(float(lost_s), 3),
        folder=folder,
        files=[ManifestFile.model_validate(f) for f in files],
        stale=list(stale or []),
        checkpoint=checkpoint,
        timings={k: round(float(v), 3) for k, v in timings.items()},
        meter=Meter.model_validate(meter(gpus, cpus, work_started_at, released_at)),
        staged_before_allocation=staged_before_allocation,
        peak_memory_bytes=peak_memory,
        spec_sha256=spec_sha256,
        finished_at=finished_at,
        stop_requested_at=stop_requested_at,
        logs=Logs(stdout_tail=stdout_tail, stderr_tail=stderr_tail, lines_not_forwarded=output_lines_dropped),
        stderr_tail=stderr_tail if verdict.status == "failed" and stderr_tail else None,
    ).to_json_dict()
