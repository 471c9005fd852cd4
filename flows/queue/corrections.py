"""Corrections that make a pool's snapshot (:class:`e31.flows.queue.snapshot.Snapshot`) valid and
truthful planner input: runs that hold more of a node than it has, runs handed over one behind
another, and a second run of a job that is already running or queued."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from e31.flows.placement.text import gib
from e31.flows.queue.mapping import AFTER_VAR, placement_of

if TYPE_CHECKING:
    from e31.flows.queue.snapshot import Snapshot


def clip_overbooked(snap: Snapshot) -> None:
    """Make the runs of a node that hold more than it has (two runs on one
    1-CPU node: a run started by hand, a flow process that outlived its
    node's loss, a crash reported before its worker held the run) valid
    planner input that keeps the node as full as it is: each GPU, CPU and
    byte of memory is counted for the run that holds it longest (latest
    ``expected_end``), and a run ending earlier keeps what is left.  At any
    time the node's free resources are then what the runs still holding
    leave, floored at 0, as with the real runs; the planner's own check
    (:class:`e31.flows.placement.capacity.Capacity`, which refuses such
    input) would otherwise fail every tick.  Each clipped node is named in
    ``snap.overbooked`` (node -> what its runs hold against what it has)."""
    by_node: dict[str, list[int]] = {}
    parts: dict[str, list[tuple[int, ...]]] = {}  # devices a gang holds on a node that is not its lead's
    for i, job in enumerate(snap.running):
        by_node.setdefault(job.node, []).append(i)
        for name, devices in job.gang:
            parts.setdefault(name, []).append(devices)
    for node in snap.nodes:
        jobs = sorted(by_node.get(node.name, ()), key=lambda i: (-snap.running[i].expected_end, snap.running[i].id))
        held = [snap.running[i] for i in jobs]
        members = [j for j in snap.running if any(name == node.name for name, _ in j.gang)]
        cpus = sum(j.cpus for j in held) + sum(j.cpus for j in members)
        memory = sum(j.memory for j in held) + sum(j.memory for j in members)
        devices = [d for j in held for d in j.devices] + [d for devs in parts.get(node.name, ()) for d in devs]
        if cpus <= node.cpus and memory <= node.memory and len(set(devices)) == len(devices) and \
                all(0 <= d < node.gpus for d in devices):
            continue
        gpus = (f", GPUs {','.join(map(str, sorted(devices))) or 'none'} of its {node.gpus}"
                if node.gpus or devices else "")
        snap.overbooked[node.name] = (f"{len(held) + len(members)} runs hold CPUs {cpus} of its {node.cpus}, "
                                      f"memory {gib(memory)} of its {gib(node.memory)}{gpus}")
        # a gang's part here is kept whole (its ranks run as placed); the node's own runs keep what is left
        taken = {d for devs in parts.get(node.name, ()) for d in devs}
        free_cpus = max(0, node.cpus - sum(j.cpus for j in members))
        free_memory = max(0, node.memory - sum(j.memory for j in members))
        for i in jobs:  # the longest holder first
            job = snap.running[i]
            mine = tuple(d for d in job.devices if 0 <= d < node.gpus and d not in taken)
            taken.update(mine)
            snap.running[i] = replace(job, devices=mine, cpus=min(job.cpus, free_cpus),
                                      memory=min(job.memory, free_memory))
            free_cpus, free_memory = free_cpus - snap.running[i].cpus, free_memory - snap.running[i].memory


def chain_handovers(snap: Snapshot, ended_at: dict[str, float] | None = None) -> None:
    """A run handed over behind a run that still holds its resources (both
    on the same node) is taken out of ``running`` and recorded in
    ``behind`` (its direct lead).  Runs handed over one behind another form
    a chain (a run's work may still wait when the next is handed over
    behind it): the chain's first run holds the resources on, until its
    planned end (at least ``now + 1`` s, the planner's rule) plus each
    handed-over run's own planned time.  Once the run ahead has ended, a
    handed-over run holds its own placement, counted from the run ahead's
    end when ``ended_at`` (run id -> Unix seconds) has it: its work began
    then, not when its flow process started."""
    holders = {r.id: r for r in snap.running}
    lead_of: dict[str, str] = {}
    for r in snap.running:
        ahead = placement_of(snap.runs[r.id]).get(AFTER_VAR)
        lead = holders.get(ahead) if isinstance(ahead, str) else None
        if lead is not None and lead.node == r.node and lead.id != r.id:
            lead_of[r.id] = lead.id

    def first(key: str) -> str | None:  # the chain's first run (None: a cycle, which no write makes)
        seen = {key}
        while key in lead_of:
            key = lead_of[key]
            if key in seen:
                return None
            seen.add(key)
        return key

    extra: dict[str, float] = {}  # first run of a chain -> seconds its handed-over runs add
    for follower, lead in lead_of.items():
        head = first(follower)
        if head is not None:
            snap.behind[follower] = lead
            extra[head] = extra.get(head, 0.0) + holders[follower].expected_end - holders[follower].start
    kept = []
    for r in snap.running:
        if r.id in snap.behind:
            continue
        ahead = placement_of(snap.runs[r.id]).get(AFTER_VAR)
        if isinstance(ahead, str) and ahead not in holders and (ended_at or {}).get(ahead, 0.0) > r.start:
            began = ended_at[ahead]
            r = replace(r, start=began, expected_end=began + (r.expected_end - r.start))
        if r.id in extra:
            r = replace(r, expected_end=max(r.expected_end, snap.now + 1.0) + extra[r.id])
        kept.append(r)
    snap.running[:] = kept


def one_run_per_job(snap: Snapshot) -> None:
    """Hold back a queued run while another run of the same job runs or is
    queued ahead of it (two runs of a job would share its destination)."""
    active = {snap.specs[r.id].name: r.id for r in snap.running}
    keep = []
    for job in sorted(snap.queued, key=lambda j: (j.submitted, j.id)):
        other = active.get(job.name)
        if other is None:
            active[job.name] = job.id
            keep.append(job)
            continue
        state = "running" if any(r.id == other for r in snap.running) else "queued ahead"
        snap.blocked[job.id] = (f"waiting for the run {job.name} ({other[:8]}) of this job, {state}, to end: one run "
                                "of a job at a time")
    snap.queued = keep
