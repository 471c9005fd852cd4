"""The one-line reason of each placement, for a person reading the plan.

    starts now on n3, GPUs 0,1, 8 CPUs, 32 GiB; expected end 04:10 UTC (run time 2h: duration)
    waiting for 6 GPUs on one node (2 free on n3); earliest start 02:40 UTC on n1, after job retrain-7 ends
    waiting for its turn (first come, first served); earliest start 03:00 UTC on n2, after job a ends
    waiting: room is free now on n2 but held for jobs ahead of it from 01:30 UTC; estimated start ...

A deadline job's reason ends with its planned end against its deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .capacity import Capacity, devices_of
from .model import QueuedJob
from .text import clock, gib, run_time, span

__all__ = ["Explainer", "ender_clause", "gang_start_reason", "start_reason"]

Clock = Callable[[float, float], str]


def _no_clock(t: float, now: float) -> str:
    """A clock time left out: what a reason's shape (:meth:`Explainer.words`) has in its place."""
    return ""


def ender_clause(ender: str) -> str:
    """The part of a waiting reason that names the job whose end its reserved start waits for."""
    return f", after job {ender} ends"


def _deadline(job: QueuedJob, end: float, now: float, clock: Clock = clock) -> str:
    if job.deadline is None or job.work_deadline is None:
        return ""
    if end <= job.work_deadline:  # its output returned by the deadline too
        return f"; ends {clock(end, now)}, before its deadline {clock(job.deadline, now)}"
    if end <= job.deadline:
        return (f"; ends {clock(end, now)}, within the {job.return_s:g} s before its deadline {clock(job.deadline, now)} "
                "kept to return its output: at risk")
    return f"; ends {clock(end, now)}, after its deadline {clock(job.deadline, now)}: at risk"


def start_reason(job: QueuedJob, node: str, devices: int, end: float, now: float) -> str:
    """``starts now on NODE, GPUs 0,1, 8 CPUs, 32 GiB; expected end ...`` (devices: a bitmask)."""
    parts = [f"starts now on {node}"]
    if devices:
        parts.append("GPUs " + ",".join(str(d) for d in devices_of(devices)))
    parts.append(f"{job.cpus} CPU{'s' if job.cpus != 1 else ''}")
    if job.memory:
        parts.append(gib(job.memory))
    when = f"; expected end {clock(end, now)} ({run_time(job)})"
    return ", ".join(parts) + when + _deadline(job, now + job.work_s, now)


def _devices(devices: Sequence[int]) -> str:
    """GPU numbers as ``0-7`` when they run unbroken, else ``0,2,5``."""
    if len(devices) > 2 and list(devices) == list(range(devices[0], devices[-1] + 1)):
        return f"{devices[0]}-{devices[-1]}"
    return ",".join(str(d) for d in devices)


def gang_start_reason(job: QueuedJob, parts: Sequence[tuple[str, Sequence[int]]], end: float, now: float) -> str:
    """``starts now on 2 nodes: n1 (GPUs 0-7), n2 (GPUs 0-7), 8 CPUs, 32 GiB each; expected end ...``:
    a multi-node job's start, ``parts`` its ``(node, GPU devices)``, first node first."""
    where = ", ".join(f"{node} (GPUs {_devices(devices)})" if devices else node for node, devices in parts)
    each = [f"{job.cpus} CPU{'s' if job.cpus != 1 else ''}"] + ([gib(job.memory)] if job.memory else [])
    return (f"starts now on {len(parts)} nodes: {where}, {', '.join(each)} each; expected end {clock(end, now)} "
            f"({run_time(job)})" + _deadline(job, now + job.work_s, now))


class Explainer:
    """Writes the reasons of one plan from its final capacity (what is idle now, who ends when);
    what is idle is summed up once per kind of request, not once per job."""

    def __init__(self, cap: Capacity, depth: int, fcfs: bool) -> None:
        self.cap, self.depth, self.fcfs = cap, depth, fcfs
        self.free = [cap.free_now(i) for i in range(len(cap.nodes))]
        self._short: dict[tuple, tuple[str, int, float, int | None]] = {}

    def _short_now(self, job: QueuedJob, eligible: Sequence[bool] | None) -> tuple[str, int, float, int | None]:
        """(what keeps the job from starting now, judged on what is idle now; node; room until; the
        resource short, 0 GPUs, 1 CPUs, 2 memory, or None)."""
        key = (id(eligible), job.gpus, job.cpus, job.memory)
        if key in self._short:
            return self._short[key]
        cap, free = self.cap, self.free
        nodes = [i for i in range(len(cap.nodes)) if eligible is None or eligible[i]]
        answer = None
        for k, (what, need, show) in enumerate((("GPU", job.gpus, str), ("CPU", job.cpus, str),
                                                 ("memory", job.memory, gib))):
            most = max(nodes, key=lambda i: (free[i][k], -i))
            if free[most][k] < need:
                amount = f"{gib(need)} of memory" if k == 2 else f"{need} {what}{'s' if need != 1 else ''}"
                answer = (f"waiting for {amount} on one node ({show(free[most][k])} free on {cap.nodes[most].name})",
                          most, cap.now, k)
                break
            nodes = [i for i in nodes if free[i][k] >= need]
        if answer is None:
            req = (job.gpus, job.cpus, job.memory, 0.0)
            room = {i: cap.room_until(i, req) for i in nodes}
            i = max(nodes, key=lambda n: (room[n], -n))
            answer = ("", i, room[i], None)
        self._short[key] = answer
        return answer

    def wait(self, job: QueuedJob, eligible: Sequence[bool] | None, node: int, start: float, reserved: bool) -> str:
        """``waiting for ...; earliest start HH:MM UTC on NODE, after job X ends`` (or ``estimated start`` for
        a job beyond the planning depth, whose start is not reserved)."""
        return self._wait(job, eligible, node, start, reserved, clock)[0]

    def words(self, job: QueuedJob, eligible: Sequence[bool] | None, node: int, start: float,
              reserved: bool) -> tuple[str, str, str | None]:
        """The reason of :meth:`wait`, its shape (the same words with every clock time left out: two reasons
        of one shape differ only in their times) and the job whose end the reserved start waits for (its
        :func:`ender_clause` is in both; None when they name none)."""
        times: list[float] = []

        def marked(t: float, now: float) -> str:  # one pass for both: each clock time marked, then filled in
            times.append(t)
            return "\0"

        text, ender = self._wait(job, eligible, node, start, reserved, marked)
        if not times:
            return text, text, ender
        parts, now = text.split("\0"), self.cap.now
        reason = "".join(part + clock(t, now) for part, t in zip(parts, times)) + parts[-1]
        return reason, "".join(parts), ender

    def gang_words(self, job: QueuedJob, eligible: Sequence[bool] | None, names: Sequence[str], start: float,
                   reserved: bool) -> tuple[str, str]:
        """A waiting multi-node job's reason and its shape (:meth:`words`): how many nodes have its room
        free now against the number it needs together, and its planned start on which nodes."""
        return tuple(self._gang_wait(job, eligible, names, start, reserved, c) for c in (clock, _no_clock))

    def _gang_wait(self, job: QueuedJob, eligible: Sequence[bool] | None, names: Sequence[str], start: float,
                   reserved: bool, clock: Clock) -> str:
        cap, now = self.cap, self.cap.now
        need = (job.gpus, job.cpus, job.memory)
        free = sum(1 for i in range(len(cap.nodes)) if (eligible is None or eligible[i])
                   and all(have >= want for have, want in zip(self.free[i], need)))
        size = f"{job.gpus} GPU{'s' if job.gpus != 1 else ''}" if job.gpus else f"{job.cpus} CPUs"
        if free < job.nodes:
            text = (f"waiting for {job.nodes} nodes with {size} free at once (a gang starts on all its nodes "
                    f"together; {free} ha{'s' if free == 1 else 've'} it free now)")
        else:
            text = f"waiting: room is free now on {free} nodes but held for jobs ahead of it"
        if reserved:
            text += f"; earliest start {clock(start, now)} on {', '.join(names)}"
        else:
            held = ("the first waiting job in priority order holds a reservation" if self.depth == 1 else
                    f"the first {self.depth} waiting jobs in priority order hold reservations")
            text += f"; estimated start {clock(start, now)} (not reserved: only {held})"
        return text + _deadline(job, start + job.work_s, now, clock)

    def _wait(self, job: QueuedJob, eligible: Sequence[bool] | None, node: int, start: float, reserved: bool,
              clock: Clock) -> tuple[str, str | None]:
        cap, now = self.cap, self.cap.now
        text, i, room, short = self._short_now(job, eligible)
        name = cap.nodes[node].name
        if short is not None and node != i and self.free[node][short] == self.free[i][short]:
            # as much free on the node it is planned on: that node is named, so the reason does not say "(0 free
            # on g-1); earliest start ... on g-2"
            text = f"{text.rsplit(' free on ', 1)[0]} free on {name})"
        local = name in job.preferred_nodes
        if not text and local and start > now:  # room is free elsewhere, but its inputs wait on this node
            text = (f"waiting for {name}, where its inputs are staged: it frees sooner than they would stage "
                    f"elsewhere (about {span(job.locality_wait_s)})")
            local = False
        elif not text:
            if self.fcfs and room - now >= job.occupancy_s:
                text = "waiting for its turn (first come, first served)"
            else:
                text = (f"waiting: room is free now on {cap.nodes[i].name} but held for jobs ahead of it "
                        f"from {clock(room, now)}")
        ender = None
        if reserved:
            text += f"; earliest start {clock(start, now)} on {name}" + (" (its inputs are staged there)" if local else "")
            ender = cap.ender(node, start)
            ender = None if ender == job.id else ender
            if ender is not None:
                text += ender_clause(ender)
        else:
            held = ("the first waiting job in priority order holds a reservation" if self.depth == 1 else
                    f"the first {self.depth} waiting jobs in priority order hold reservations")
            text += f"; estimated start {clock(start, now)} (not reserved: only {held})"
        return text + _deadline(job, start + job.work_s, now, clock), ender
