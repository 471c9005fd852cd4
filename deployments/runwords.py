"""What ``e31 submit`` and ``e31 queue`` say of a run: its plan, or what
it is doing while it holds its node (read from the scheduler's snapshot)."""

from __future__ import annotations

from typing import Any


def submitted_line(snap: Any, placements: list[Any], key: str) -> str | None:
    """What ``e31 submit`` says of the run ``key`` it just queued, from a
    snapshot read after the submission: its plan (start now on a node, or
    waiting and why), held back behind another run of the same job,
    already placed by the scheduler (which may tick between the submission
    and this read), or handed over behind a running job; None when the run
    is in none of them (it ended already)."""
    from e31.flows.queue import humane

    mine = next((p for p in placements if p.job == key), None)
    if mine is not None:
        return humane(describe(mine), snap)
    if key in snap.blocked:
        return humane(snap.blocked[key], snap)  # "waiting for the run ... of this job, ..., to end"
    if key in snap.behind:
        ahead = snap.behind[key]
        return f"handed over behind {snap.specs[ahead].name} ({ahead[:8]}): its work starts once that job has ended"
    held = next((r for r in snap.running if r.id == key), None)
    if held is not None:
        return f"placed on {held.node}{_gpus(held.devices)} by the scheduler already: {holding(snap.runs[key].state)}"
    return None


def _gpus(devices: Any) -> str:
    """``, GPUs 0,1`` (device numbers) for a placement's devices, or nothing."""
    return f", GPUs {','.join(map(str, devices))}" if devices else ""


def describe(p: Any) -> str:
    """One placement in words: ``start now on NODE, GPUs 0,1``, ``refused: ...`` or its waiting reason."""
    if p.action == "start":
        return f"start now on {p.node}{_gpus(p.devices)}"
    if p.action == "refuse":
        return f"refused: {p.reason}"
    return p.reason if p.reason.startswith("waiting") else f"waiting: {p.reason}"


def holding(state: Any) -> str:
    """What ``e31 queue`` says of a run that holds its node's resources,
    from its flow run ``state`` (Prefect's ``Scheduled`` named ``Placed``,
    ``Pending``, ``Running`` or ``Cancelling``)."""
    kind = state.type.value
    if kind == "CANCELLING":
        return "cancelling: its work is being stopped and its latest output returned"
    if kind == "PENDING":
        return "starting: its worker is starting its flow process"
    if kind == "SCHEDULED":
        return "placed: its worker starts it within seconds"
    return "running"
