"""What the planner reads and writes: nodes, running jobs, queued jobs, placements.

Plain frozen dataclasses, standard library only.  Times are Unix seconds
(floats); durations are seconds; memory is BYTES; GPU devices are the
node's device numbers ``0 .. gpus-1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from e31.errors import InvalidInput

__all__ = ["Action", "Gang", "Node", "PlanInputError", "Placement", "QueuedJob", "RunningJob", "RuntimeSource", "id_order"]

Action = Literal["start", "wait", "refuse"]
RuntimeSource = Literal["duration", "history", "limit"]


def id_order(job_id: str) -> tuple[int, int, str]:
    """The key that orders job ids among equals (same submission time): ids made of ASCII digits
    (an SWF trace's job numbers) by their number, so job 9 comes before job 10; every other id (a
    flow run's UUID, a job name) after them, as text."""
    if job_id.isascii() and job_id.isdigit():
        return 0, int(job_id), job_id
    return 1, 0, job_id


class PlanInputError(InvalidInput):
    """The planner's input contradicts itself: a running job on a node not in
    the pool, on devices the node lacks, or overlapping another running job;
    two nodes or two jobs with one name.  Exits 2 from the command line."""


@dataclass(frozen=True)
class Node:
    """One machine of the pool.

    ``gpus``: GPU devices, numbered ``0 .. gpus-1``; ``gpu_type``: their model
    (``H100``) or None; ``cpus``: cores; ``memory``: BYTES; ``group``: the nodes
    that share a fast network (a rack, a switch) carry one group name, None: no
    group.  A multi-node job (a gang) prefers nodes of one group.
    """

    name: str
    gpus: int
    cpus: int
    memory: int
    gpu_type: str | None = None
    group: str | None = None


#: The other nodes of a multi-node job: ``(node name, GPU devices held there)`` per node.
Gang = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class RunningJob:
    """A job already running on ``node``, holding ``devices`` (GPU numbers),
    ``cpus`` and ``memory`` (BYTES) from ``start`` until ``expected_end``
    (Unix seconds).  Give the end the estimate promised (start + staging +
    planning runtime); once that has passed, a new guess no later than its hard
    stop (start + staging + limit; :func:`.simulate.overrun` is the simulator's
    rule).  The planner treats an end at or before ``now`` as ``now + 1`` s: the
    job still holds its resources.

    For preemption (:mod:`.preemption`): ``preemptible`` (the job's
    ``request.preemptible``), ``checkpoint_at`` (when its newest durable
    checkpoint was committed, Unix seconds; None: none yet, a preemption loses
    everything since ``start``), ``priority`` (higher is more important; equal
    for every job until tenants bring priorities), ``preemptions`` (when it was
    preempted before, Unix seconds, for the pool's ``max_per_day``), ``attained_s``
    (resource-seconds it received in earlier runs: GPU-seconds, CPU-seconds
    for a job of no GPU; :mod:`.attained`), ``no_duration`` (it declared no
    duration: ordered by attained service, it may have started in room
    reserved for another job, :mod:`.attained`), ``tenant`` (the pool's tenant
    it runs for, :mod:`.tenants`).

    A multi-node job (a gang) holds ``node`` and ``devices`` on its first node and
    ``gang``, its other nodes with the devices it holds on each, the same ``cpus`` and
    ``memory`` on every node; it is never a victim of preemption."""

    id: str
    node: str
    devices: tuple[int, ...]
    cpus: int
    memory: int
    start: float
    expected_end: float
    preemptible: bool = False
    checkpoint_at: float | None = None
    priority: int = 0
    preemptions: tuple[float, ...] = ()
    attained_s: float = 0.0
    no_duration: bool = False
    tenant: str = "default"
    gang: Gang = ()

    @property
    def parts(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Every node it holds with its devices there: ``(node, devices)``, its first node first."""
        return ((self.node, self.devices), *self.gang)

    @property
    def gpus_held(self) -> int:
        """GPU devices it holds on all its nodes together."""
        return sum(len(devices) for _, devices in self.parts)


@dataclass(frozen=True)
class QueuedJob:
    """A job waiting to be placed.

    Attributes:
        id: unique among queued and running jobs; named in reasons and used to break ties.
        name: the job's name (its spec's ``name``; several runs may share it).
        gpus, cpus, memory: the request per node (memory in BYTES; 0 means not stated).
        nodes: how many nodes it needs at once (a gang: all start together or none does;
            1: a single-node job).  Its GPUs are ``gpus`` whole devices on each.
        gpu_type: run only on nodes of this GPU model (case-insensitive), or None.
        submitted: when it joined the queue (Unix seconds).
        deadline: finish-by time (Unix seconds) or None: the output returned by then.
        return_s: seconds before ``deadline`` kept for returning the output (E31's
            return reserve, ``E31_RETURN_RESERVE_S``, 30 s by default): the work
            itself must end by :attr:`work_deadline`, where the run stops it.
        staging_s: seconds to stage its inputs on the node, before the work starts.
        runtime_s: the planning estimate of the run time in seconds (see ``runtime_source``).
        limit_s: the hard stop in seconds after the work starts.
        runtime_source: where ``runtime_s`` came from: the declared ``duration``,
            the job's own ``history`` (past runs), or its ``limit``.
        runtime_note: how to say the source in a reason (default: the source's name,
            e.g. ``p90 of 14 past runs`` for history).
        preferred_nodes: nodes that already hold its inputs staged; among equal
            start times the planner picks one of these.
        locality_wait_s: seconds later than its earliest start elsewhere it
            may start on a preferred node and still go there (the staging
            that node saves; delay scheduling, Zaharia et al., EuroSys 2010);
            0: only an equally early start.
        planned_node: the node an earlier plan reserved its start on (its
            prefetch may be under way there); among equally early starts it
            is kept, after ``preferred_nodes``, so the plan does not move a
            job between equally free nodes from one tick to the next.
        start_s: seconds from its placement until its flow run starts on the
            node (the worker's poll and the flow process's start; measured by
            the live queue, 0 in replays): part of its occupancy.
        output_s: seconds to return its output after the work ends (measured
            by the live queue from past runs' manifests, 0 in replays): part of
            its occupancy, so a job planned into a gap holds the node until its
            output is back.
        preemptible: its ``request.preemptible``.  A preemptible job that declared
            no duration (``runtime_source`` ``limit``) is ordered by the service it
            has received and starts in any free room (:mod:`.attained`).
        attained_s: resource-seconds it received in earlier runs (GPU-seconds,
            CPU-seconds for a job of no GPU), 0 before its first start.
        waiting_since: when its current wait began (Unix seconds): its last
            preemption; None: ``submitted``.
        tenant: the pool's tenant it was submitted for (:mod:`.tenants`).
    """

    id: str
    name: str
    gpus: int
    cpus: int
    memory: int
    submitted: float
    runtime_s: float
    limit_s: float
    gpu_type: str | None = None
    deadline: float | None = None
    staging_s: float = 0.0
    runtime_source: RuntimeSource = "limit"
    runtime_note: str = ""
    preferred_nodes: tuple[str, ...] = field(default=())
    locality_wait_s: float = 0.0
    planned_node: str | None = None
    return_s: float = 0.0
    start_s: float = 0.0
    output_s: float = 0.0
    preemptible: bool = False
    attained_s: float = 0.0
    waiting_since: float | None = None
    tenant: str = "default"
    nodes: int = 1

    @property
    def work_deadline(self) -> float | None:
        """When the work must end for its output to be back by the deadline
        (``deadline - return_s``, Unix seconds), or None without a deadline."""
        return None if self.deadline is None else self.deadline - self.return_s

    @property
    def occupancy_s(self) -> float:
        """Seconds it holds a node by the plan: its start, staging, the runtime estimate and the
        return of its output (never below 1 s)."""
        return max(self.start_s + self.staging_s + self.runtime_s + self.output_s, 1.0)

    @property
    def hard_occupancy_s(self) -> float:
        """Seconds it may hold a node at most: as :attr:`occupancy_s` with the ``limit`` in place of
        the estimate (the run stops its work at the limit), never below :attr:`occupancy_s`."""
        return max(self.start_s + self.staging_s + self.limit_s + self.output_s, self.occupancy_s)

    @property
    def work_s(self) -> float:
        """Seconds from its start on a node until its work is expected to end (start, staging and
        the runtime estimate; the output's return comes after): what a deadline is judged on
        against :attr:`work_deadline`."""
        return self.start_s + self.staging_s + self.runtime_s


@dataclass(frozen=True)
class Placement:
    """The planner's answer for one queued job.

    ``action``: ``start`` (now, on ``node`` with ``devices``), ``wait`` (planned
    to start at ``start`` on ``node``; ``devices`` as planned) or ``refuse``
    (``node`` None, ``start``/``end`` None).  ``start``/``end`` are Unix
    seconds (``end`` = start + staging + runtime estimate).  ``reason`` is one
    line for a person.  ``reserved`` is False for a waiting job beyond the
    planning depth: its start is an estimate, not a reservation.  For a
    waiting job: ``ender``, the job whose end its reserved start waits for
    (None: none), and ``shape``, its reason with every clock time left out
    (what the scheduler compares to know whether the words changed beyond
    their times; words are never read back).
    """

    job: str
    action: Action
    node: str | None
    devices: tuple[int, ...]
    cpus: int
    start: float | None
    end: float | None
    reason: str
    reserved: bool = True
    ender: str | None = None
    shape: str = ""
    gang: Gang = ()
