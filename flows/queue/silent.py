"""A waiting job's reason where a node without a live ``e31 worker``
matters, from the snapshot's facts (which nodes are silent, what their runs
hold), not from the planner's words: the planner sees a silent node held
whole by a stand-in (:data:`e31.flows.queue.mapping.DOWN`) until its lease's
end, so its reason said a resource was short there ("0 free on c-2") or
planned a start that slid at every read ("earliest start 19:35:49 UTC on
c-2").  A node really short keeps the planner's reason."""

from __future__ import annotations

from typing import Any

from e31.flows.placement.text import clock, gib
from e31.flows.queue.mapping import DOWN


def silent_nodes(snap: Any) -> set[str]:
    """The nodes the snapshot holds for want of a live worker (its ``DOWN`` stand-ins; a fenced node is not one:
    its fence says why it waits)."""
    return {r.node for r in snap.running if r.id.startswith(DOWN)}


def _free(snap: Any, node: Any) -> tuple[int, int, int]:
    """(GPUs, CPUs, memory bytes) of ``node`` that its runs (not the stand-ins) leave now."""
    held = [r for r in snap.running if r.node == node.name and r.id in snap.runs]
    return (node.gpus - len({d for r in held for d in r.devices}), node.cpus - sum(r.cpus for r in held),
            node.memory - sum(r.memory for r in held))


def _fits(job: Any, node: Any, free: tuple[int, int, int]) -> bool:
    return (job.gpu_type is None or job.gpu_type == node.gpu_type or not job.gpus) and \
        free[0] >= job.gpus and free[1] >= job.cpus and free[2] >= job.memory


def _worker(snap: Any, node: str) -> str:
    beat = snap.heard.get(node)
    return "never heard" if beat is None else f"last heard {max(0.0, snap.now - beat):.0f} s ago"


def _ender(snap: Any, node: str, start: float) -> str | None:
    """The run on ``node`` whose planned end is ``start`` (the planner's rule: an end past counts as now + 1 s)."""
    for r in snap.running:
        if r.node == node and r.id in snap.runs and abs(max(r.expected_end, snap.now + 1.0) - start) <= 1.0:
            return r.id
    return None


def wait_reason(p: Any, snap: Any) -> str:
    """The reason of the waiting placement ``p`` (an
    :class:`e31.flows.placement.Placement`) against ``snap`` (the
    :class:`e31.flows.queue.Snapshot` it was planned from), still naming
    runs by id (:func:`e31.flows.queue.humane` names them).  ``p.reason``
    unless a silent node matters: ``p`` is planned on one, or the job would
    fit now on one (what its runs leave).  Then::

        waiting for 4 CPUs on one node (1 free on c-1); c-2 has room but no live e31 worker (last heard 75 s ago):
        no start planned there until its worker answers

    (``(N free on NODE)``: the most a node with a live worker has of the
    first resource short, in the planner's order GPUs, CPUs, memory;
    omitted when one has room now), and for a start planned on a node with
    a live worker ``; earliest start HH:MM UTC on NODE, after job ID ends``
    (``estimated start`` beyond the planner's reservations)."""
    silent = silent_nodes(snap)
    job = next((q for q in snap.queued if q.id == p.job), None)
    if p.action != "wait" or job is None or not silent:
        return p.reason
    nodes = {n.name: n for n in snap.nodes}
    free = {name: _free(snap, node) for name, node in nodes.items()}
    room = [name for name in sorted(silent) if name in nodes and _fits(job, nodes[name], free[name])]
    if p.node not in silent and not room:
        return p.reason  # short for real: the planner's words hold
    need = [f"{job.gpus} GPU{'s' if job.gpus != 1 else ''}"] if job.gpus else []
    need.append(f"{job.cpus} CPU{'s' if job.cpus != 1 else ''}")
    if job.memory:
        need.append(f"{gib(job.memory)} of memory")
    text = f"waiting for {', '.join(need)} on one node"
    live = [name for name in nodes if name not in silent and not any(
        r.node == name and r.id not in snap.runs for r in snap.running)]  # a fenced node is held whole
    candidates = [name for name in live if not (job.gpus and job.gpu_type and nodes[name].gpu_type != job.gpu_type)]
    if not candidates:
        text += " (no node has a live e31 worker)" if not live else ""
    elif not any(_fits(job, nodes[name], free[name]) for name in candidates):
        for k, need_k, show in ((0, job.gpus, str), (1, job.cpus, str), (2, job.memory, gib)):
            most = max(candidates, key=lambda name: (free[name][k], -list(nodes).index(name)))
            if free[most][k] < need_k:
                text += f" ({show(max(free[most][k], 0))} free on {most})"
                break
            candidates = [name for name in candidates if free[name][k] >= need_k]
    said = [f"{name} has room but no live e31 worker ({_worker(snap, name)})" for name in room]
    if p.node in silent and p.node not in room:
        said.append(f"{p.node} has no live e31 worker ({_worker(snap, p.node)})")
    text += "; " + "; ".join(said)
    if p.node in silent:
        return text + ": no start planned there until its worker answers"
    if p.start is None or p.node is None:
        return text
    if not p.reserved:
        return text + f"; estimated start {clock(p.start, snap.now)}"
    ender = _ender(snap, p.node, p.start)
    return text + f"; earliest start {clock(p.start, snap.now)} on {p.node}" + \
        (f", after job {ender} ends" if ender is not None and ender != p.job else "")
