"""The placement record: what the E31 scheduler decided for one flow run,
typed, with the one codec of the flow run's ``placement`` parameter.

The scheduler writes it (:mod:`e31.flows.queue.record`); the worker, a
node's prefetcher, the next plan and the fence of a lost run read it.  The
state message beside it is words for a person, never read back: every
decision the queue takes from a run is taken from this record, the run's
state type and name, its scheduled time and its tags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from e31.tasks.supervisor.fence import NODE_VAR, placement_of

__all__ = ["AFTER_VAR", "ATTAINED_VAR", "ATTEMPT_VAR", "CPUS_VAR", "DEVICES_VAR", "FREE_VAR", "NODE_VAR",
           "GANG_VAR", "LOST_VAR", "PLANNED_VAR", "PREEMPTED_VAR", "VICTIMS_VAR", "PlacementRecord", "PlannedStart", "record_of"]

#: The keys of the ``placement`` parameter (:data:`e31.tasks.supervisor.fence.PLACEMENT_PARAM`).
DEVICES_VAR, CPUS_VAR, ATTEMPT_VAR = "gpu_devices", "cpus", "e31_attempt"
#: The run a handed-over run waits behind.
AFTER_VAR = "e31_after"
#: Attempts that crashed before their work started (they use none of the run's retries).
FREE_VAR = "e31_unstarted"
#: The node a waiting run's reserved start is planned on (absent: no reservation, or not planned yet).
PLANNED_VAR = "e31_planned"
#: The runs a run placed by a preemption waits for: the queue stops them, and its work starts once every one
#: of them has returned its output (:mod:`e31.flows.queue.preempt`).
VICTIMS_VAR = "e31_preempts"
#: When the run was preempted (Unix seconds, oldest first): those attempts use none of its retries, and the
#: pool's ``preemption.max_per_day`` counts them.
PREEMPTED_VAR = "e31_preempted"
#: Resource-seconds (GPU-seconds; CPU-seconds for a job of no GPU) the run received in its earlier attempts:
#: its attained service, by which the planner orders jobs that declared no duration.
ATTAINED_VAR = "e31_attained_s"
#: Seconds of work the run's preemptions threw away (each: from its newest durable checkpoint to the decision).
LOST_VAR = "e31_lost_s"
#: The other nodes of a placed multi-node run (a gang), in rank order: ``[[node, [devices]], ...]``; its lead
#: (rank 0) is :data:`NODE_VAR`.  The same ``cpus`` on each.
GANG_VAR = "e31_gang"


@dataclass(frozen=True)
class PlannedStart:
    """A waiting run's reserved start: the ``node`` it is planned on and
    when (``start``, Unix seconds: the run's scheduled time, which the
    scheduler keeps at the planned start, at least ``AHEAD_S`` ahead; None
    when the run has none)."""

    node: str
    start: float | None


@dataclass(frozen=True)
class PlacementRecord:
    """One flow run's ``placement`` parameter, typed.

    ``node``, ``devices`` (GPU indices) and ``cpus``: where a placed run
    starts (None, (), None while it waits).  ``after``: the flow run id of
    the run it is handed over behind (its work starts once that one has
    returned its output).  ``attempt``: the run's attempt as the scheduler
    counted it (Prefect's ``run_count`` when placed; None: not written).
    ``unstarted``: its attempts that crashed before their work started.
    ``planned``: the node a waiting run's reserved start is planned on (the
    node whose prefetcher stages its inputs; the next plan keeps it between
    equally free nodes).  ``victims``: the runs its placement preempts (its
    work starts once each has returned its output); ``preempted``: when it
    was preempted (Unix seconds); ``attained_s``: the resource-seconds its
    earlier attempts received; ``lost_s``: the seconds of work its
    preemptions threw away.  ``gang``: a multi-node run's other nodes, in
    rank order (rank 1 first), each with its GPU devices there; ``node`` is
    its lead, rank 0."""

    node: str | None = None
    devices: tuple[int, ...] = field(default=())
    cpus: int | None = None
    attempt: int | None = None
    after: str | None = None
    unstarted: int = 0
    planned: str | None = None
    victims: tuple[str, ...] = field(default=())
    preempted: tuple[float, ...] = field(default=())
    attained_s: float = 0.0
    lost_s: float = 0.0
    gang: tuple[tuple[str, tuple[int, ...]], ...] = field(default=())

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node it is placed on, its lead first (() while it waits)."""
        return ((self.node,) if self.node is not None else ()) + tuple(name for name, _ in self.gang)

    def rank_of(self, node: str) -> int | None:
        """The rank of ``node`` in the run's gang (0: its lead), or None when it is not one of its nodes."""
        nodes = self.nodes
        return nodes.index(node) if node in nodes else None

    def waits_for(self) -> tuple[str, ...]:
        """The runs whose output must be returned before this run's work starts: the run it is handed over
        behind and the runs its placement preempts."""
        return tuple(dict.fromkeys(r for r in (self.after, *self.victims) if r))

    def kept(self) -> PlacementRecord:
        """What a run taken back into the queue keeps: its attempt and the counts its retries and the
        planner's order are judged by (no node, devices, runs it waits for or planned node)."""
        return PlacementRecord(attempt=self.attempt, unstarted=self.unstarted, preempted=self.preempted,
                               attained_s=self.attained_s, lost_s=self.lost_s)

    def parameter(self) -> dict[str, Any]:
        """The ``placement`` parameter's value (JSON): only the keys that
        are set, in the order the worker and the fence read them."""
        value: dict[str, Any] = {}
        if self.node is not None:
            value.update({NODE_VAR: self.node, DEVICES_VAR: list(self.devices), CPUS_VAR: self.cpus})
        if self.attempt is not None:
            value[ATTEMPT_VAR] = self.attempt
        if self.after is not None:
            value[AFTER_VAR] = self.after
        if self.unstarted:
            value[FREE_VAR] = self.unstarted
        if self.planned is not None:
            value[PLANNED_VAR] = self.planned
        if self.victims:
            value[VICTIMS_VAR] = list(self.victims)
        if self.preempted:
            value[PREEMPTED_VAR] = list(self.preempted)
        if self.attained_s:
            value[ATTAINED_VAR] = self.attained_s
        if self.lost_s:
            value[LOST_VAR] = self.lost_s
        if self.gang:
            value[GANG_VAR] = [[name, list(devices)] for name, devices in self.gang]
        return value

    @classmethod
    def from_parameter(cls, value: Any) -> PlacementRecord:
        """The record of a ``placement`` parameter's value (a dict; anything
        else, and any key of the wrong type, reads as not set)."""
        if not isinstance(value, dict):
            return cls()
        devices = value.get(DEVICES_VAR)
        return cls(node=_text(value.get(NODE_VAR)),
                   devices=tuple(d for d in devices if isinstance(d, int)) if isinstance(devices, list) else (),
                   cpus=_count(value.get(CPUS_VAR)), attempt=_count(value.get(ATTEMPT_VAR)),
                   after=_text(value.get(AFTER_VAR)), unstarted=_count(value.get(FREE_VAR)) or 0,
                   planned=_text(value.get(PLANNED_VAR)),
                   victims=tuple(v for v in _list(value.get(VICTIMS_VAR)) if isinstance(v, str) and v),
                   preempted=tuple(float(t) for t in _list(value.get(PREEMPTED_VAR)) if _number(t)),
                   attained_s=float(value.get(ATTAINED_VAR)) if _number(value.get(ATTAINED_VAR)) else 0.0,
                   lost_s=float(value.get(LOST_VAR)) if _number(value.get(LOST_VAR)) else 0.0,
                   gang=_gang(value.get(GANG_VAR)))


def record_of(run: Any) -> PlacementRecord:
    """The placement record of the flow run ``run`` (a Prefect ``FlowRun``):
    its ``placement`` parameter, or the ``job_variables`` of a run placed
    before the parameter existed (:func:`e31.tasks.supervisor.fence.placement_of`)."""
    return PlacementRecord.from_parameter(placement_of(run))


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None



def _gang(value: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The members of a ``placement``'s gang; one member of the wrong shape makes the whole gang unread (()):
    a gang short of a node would start its ranks with a wrong world size."""
    members = []
    for item in _list(value):
        if not (isinstance(item, list) and len(item) == 2 and _text(item[0]) and isinstance(item[1], list)
                and all(_count(d) is not None for d in item[1])):
            return ()
        members.append((item[0], tuple(item[1])))
    return tuple(members)


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 and value == value
