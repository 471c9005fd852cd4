"""Whether a job may be preempted, from its declaration (``request.preemptible`` and its checkpoints).

A preempted job is stopped like any other stop (the stop warning, the grace, its newest checkpoint
committed and its output returned marked partial), queued again as the same job and resumed from that
checkpoint.  What it loses is the work since its newest durable checkpoint, so the default lets a
queue preempt exactly the jobs for which that loss is bounded and no deadline is at stake.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .models import JobSpec

__all__ = ["checkpoints_declared", "has_deadline", "is_preemptible", "preemption_notes"]


def checkpoints_declared(spec: JobSpec) -> bool:
    """True when the job says how often it checkpoints (``output.checkpoint.every`` or ``every_steps``):
    a stop then loses at most the work since its newest durable checkpoint."""
    policy = spec.output.checkpoint
    return policy.every is not None or policy.every_steps is not None


def has_deadline(spec: JobSpec) -> bool:
    """True when the job declares any kind of deadline (``deadline``, ``deadline_within``, ``deadline_at``)."""
    req = spec.request
    return req.deadline is not None or req.deadline_within is not None or req.deadline_at is not None


def is_preemptible(spec: JobSpec) -> bool:
    """Whether a queue may preempt ``spec``'s runs: ``request.preemptible`` when given; otherwise true for
    a job that declares checkpoints (:func:`checkpoints_declared`) and no deadline (:func:`has_deadline`),
    whose preemption costs at most one checkpoint interval and no promised finish time; false otherwise."""
    if spec.request.preemptible is not None:
        return spec.request.preemptible
    return checkpoints_declared(spec) and not has_deadline(spec)


def preemption_notes(spec: JobSpec) -> list[str]:
    """One sentence per preemption setting that is valid but probably not meant: a job made preemptible
    by hand that declares no checkpoints (each preemption would lose all its work), or that has a
    deadline (the queue may then stop it, which its deadline is not protected from)."""
    notes = []
    if spec.request.preemptible and not checkpoints_declared(spec):
        notes.append("request.preemptible: the job declares no checkpoints, so each preemption loses all its "
                     "work so far; add output.checkpoint.every (e.g. 10m) and save checkpoints in the work")
    if spec.request.preemptible and has_deadline(spec):
        notes.append("request.preemptible: true on a job with a deadline: the queue may preempt it, and the "
                     "time it waits to run again counts towards its deadline; drop request.preemptible (a "
                     "deadline job is not preemptible by default) to keep it running")
    return notes
