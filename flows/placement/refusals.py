"""Refusals: a request no node can hold, and a deadline that cannot be met.

A queued job is refused, with the reason, when

* no node of the pool can hold it: no node of its ``gpu_type``, or more GPUs,
  CPUs or memory than any one (eligible) node has, or no single node with all
  three at once (a job's GPUs are whole devices on one node; a multi-node job
  asks for that on each of its nodes), or fewer such nodes than a multi-node
  job needs;
* its deadline cannot be met even on an empty pool: ``submitted + staging +
  runtime > deadline`` (refused at submission), or ``now + staging + runtime >
  deadline`` (it became infeasible while it waited: taken out rather than run
  to miss it).
"""

from __future__ import annotations

from collections.abc import Sequence

from .model import Node, QueuedJob
from .text import clock, gib, run_time

__all__ = ["deadline_refusal", "eligible_nodes", "fit_refusal", "multi_node_refusal", "same_type"]


def same_type(node: Node, gpu_type: str | None) -> bool:
    """True when ``node`` serves a job asking for ``gpu_type`` (None: any node; case-insensitive)."""
    return gpu_type is None or (node.gpu_type is not None and node.gpu_type.lower() == gpu_type.lower())


def eligible_nodes(nodes: Sequence[Node], job: QueuedJob) -> list[bool]:
    """For each node: does it have the job's GPU type and at least its GPUs, CPUs and memory?"""
    return [same_type(n, job.gpu_type) and n.gpus >= job.gpus and n.cpus >= job.cpus and n.memory >= job.memory
            for n in nodes]


def _types(nodes: Sequence[Node]) -> str:
    counts: dict[str, int] = {}
    for node in nodes:
        if node.gpu_type:
            counts[node.gpu_type] = counts.get(node.gpu_type, 0) + 1
    if not counts:
        return "no node of the pool names a GPU type"
    parts = [f"{name} on {n} node{'s' if n > 1 else ''}" for name, n in sorted(counts.items())]
    return "the pool has " + ", ".join(parts)


def fit_refusal(nodes: Sequence[Node], job: QueuedJob, eligible: Sequence[bool]) -> str | None:
    """Why no node can hold ``job`` and what to change (one line), or None when one can; for a
    multi-node job (``job.nodes`` > 1), None when that many nodes can each hold its per-node request."""
    held = sum(1 for ok in eligible if ok)
    if held and held < job.nodes:
        each = ([f"{job.gpus} GPU{'s' if job.gpus != 1 else ''}"] if job.gpus else []) + \
            [f"{job.cpus} CPU{'s' if job.cpus != 1 else ''}"] + ([gib(job.memory)] if job.memory else [])
        return (f"asks for {job.nodes} nodes of {', '.join(each)} each, and only {held} node"
                f"{'s' if held != 1 else ''} of the pool can hold that: ask for at most {held} nodes, or add nodes "
                "to the pool file")
    if held:
        return None
    typed = [n for n in nodes if same_type(n, job.gpu_type)]
    if not typed:
        return (f"no node has GPU type {job.gpu_type} ({_types(nodes)}): set request.gpu_type to one of those, or "
                "add such nodes to the pool file")
    kind = f"{typed[0].gpu_type} " if job.gpu_type else ""
    short, fix = [], []
    most = max(n.gpus for n in typed)
    if job.gpus > most:
        short.append(f"no node can hold {job.gpus} GPUs: the largest {kind}nodes have {most} GPUs")
        fix.append(f"{most} GPUs (request.gpus)")
    most = max(n.cpus for n in typed)
    if job.cpus > most:
        short.append(f"no node can hold {job.cpus} CPUs: the largest {kind}nodes have {most} CPUs")
        fix.append(f"{most} CPUs (request.cpus)")
    most = max(n.memory for n in typed)
    if job.memory > most:
        short.append(f"no node can hold {gib(job.memory)} of memory: the largest {kind}nodes have {gib(most)}")
        fix.append(f"{gib(most)} of memory (request.memory)")
    if short:
        spread = _spread(typed, job) if job.nodes == 1 else None
        also = f", {spread}" if spread else ""
        return f"{'; '.join(short)}: ask for at most {' and '.join(fix)}{also}, or add a larger node to the pool file"
    big = max(typed, key=lambda n: (n.gpus, n.cpus, n.memory))
    asked = [f"{job.gpus} GPUs", f"{job.cpus} CPUs"] + ([gib(job.memory)] if job.memory else [])
    return (f"no single {kind}node has {', '.join(asked[:-1])} and {asked[-1]} together "
            f"(largest: {big.name} with {big.gpus} GPUs, {big.cpus} CPUs, {gib(big.memory)}): ask for less, or add "
            "a larger node to the pool file")


def _spread(typed: Sequence[Node], job: QueuedJob) -> str | None:
    """The fewest nodes the one-node request ``job`` splits over exactly (its GPUs divided evenly, its
    CPUs and memory divided and rounded up) with enough ``typed`` nodes to hold a share each, as the
    fix's words; None when no such split exists."""
    for n in range(2, len(typed) + 1):
        if job.gpus % n:
            continue
        # rounded up (memory to whole MiB, as it is written): the shares together never ask for less
        gpus, cpus, memory = job.gpus // n, -(-job.cpus // n), -(-job.memory // (n * 2**20)) * 2**20
        if sum(1 for x in typed if x.gpus >= gpus and x.cpus >= cpus and x.memory >= memory) < n:
            continue
        each = [f"request.gpus: {gpus}"] if job.gpus else []
        each += [f"request.cpus: {cpus}"] if cpus != job.cpus else []
        each += [f"request.memory: {gib(memory)}"] if memory else []
        return f"spread it over {n} nodes (request.nodes: {n} with {', '.join(each)} per node)"
    return None


def multi_node_refusal(nodes: int) -> str:
    """Why a job of ``nodes`` > 1 nodes cannot run where it was started (one line, with the fix): only a
    queue's scheduler places a gang on several nodes at once (:mod:`e31.flows.gang`); ``e31 run`` and the
    flow called from Python start on one machine."""
    return (f"request.nodes: {nodes}: a job across several nodes runs in a queue, which starts it on {nodes} nodes "
            f"at once: e31 submit SPEC --pool POOL; e31 run and the flow called directly start one node (or set "
            "request.nodes: 1; gpus, cpus and memory are per node)")


def deadline_refusal(job: QueuedJob, now: float) -> str | None:
    """Why ``job``'s deadline cannot be met even if it started at once (one line), or None."""
    if job.deadline is None or job.work_deadline is None:
        return None
    need, by = job.work_s, job.work_deadline
    reserve = f", and {job.return_s:g} s to return its output before the deadline" if job.return_s else ""
    if job.submitted + need > by:
        return (f"deadline {clock(job.deadline, now)} cannot be met even on an empty pool: started when submitted "
                f"({clock(job.submitted, now)}) it would end {clock(job.submitted + need, now)} ({run_time(job)}"
                f"{reserve})")
    if now + need > by:
        where = (f"after its deadline {clock(job.deadline, now)}" if now + need > job.deadline else
                 f"within the {job.return_s:g} s before its deadline {clock(job.deadline, now)} kept to return its "
                 "output")  # an end within the reserve is before the deadline: not "after" it
        return (f"deadline became infeasible while queued: started now ({clock(now, now)}) it would end "
                f"{clock(now + need, now)}, {where} ({run_time(job)})")
    return None
