"""Names and values the queue's mapping onto Prefect uses: the work pool and
deployment of a pool, the state names, the keys of a run's ``placement``,
and the queue's clock constants (seconds)."""

from __future__ import annotations

from typing import Any

from e31.flows.placement import Node
from e31.specs.pool import PoolSpec
# the state names of a waiting and of a placed run (both of type ``Scheduled``), defined with their builders
from e31.states import PLACED, QUEUED  # noqa: F401
from e31.tasks.supervisor.fence import NODE_VAR as FENCE_NODE_VAR  # the flow process fences on it
from e31.tasks.supervisor.fence import PLACEMENT_PARAM, placement_of  # noqa: F401 (the queue's, defined for the fence)
from e31.tasks.placement_record import (AFTER_VAR, ATTEMPT_VAR, CPUS_VAR, DEVICES_VAR, FREE_VAR, PLANNED_VAR,  # noqa: F401
                                        PlacementRecord, PlannedStart, record_of)

#: The Prefect worker type of E31 work pools (``e31 worker``, :mod:`e31.deployments.worker`).
WORKER_TYPE = "e31"
#: The node, GPU devices and CPUs of a placement, and the run's attempt: keys of its ``placement`` parameter
#: (:data:`e31.tasks.supervisor.fence.PLACEMENT_PARAM`), written and read as a typed
#: :class:`e31.tasks.placement_record.PlacementRecord` (:func:`record_of`; :func:`placement_of` gives the dict).
NODE_VAR = FENCE_NODE_VAR
#: The node a waiting run's reserved start is planned on, in its ``placement`` (:class:`PlacementRecord`
#: ``planned``; read with :func:`planned_start`): that node's ``e31 worker`` prefetches the run's inputs, and the
#: next plan keeps it between equally free nodes.  Written only when it changes (a plain update of the
#: parameters beside the state write; not a ``job_variables`` write: Prefect validates every
#: ``job_variables`` PATCH against the work pool's whole variables schema inside a write transaction, which was
#: the largest single cost of the server under a busy queue: bench_queue, py-spy, 17 % of its busy CPU).
#: The node a placed run starts on is also a tag of the run, :data:`PLACED_TAG` + node, written in the same
#: update as its placement: the server's ``Placed`` events carry a run's tags (not its parameters), and a
#: worker told of a placement polls at once only for its own node's (:func:`placed_on`; a tag lost to a
#: prefetcher's concurrent tag write costs only latency: an event naming no node wakes every worker, and each
#: polls by itself every QUIET_POLL_S).
PLACED_TAG = "e31-placed:"
#: Each other node of a placed multi-node run (a gang) is a tag of the run, :data:`MEMBER_TAG` + node, written
#: with its :data:`PLACED_TAG`: the ``e31 worker`` of each such node finds the runs it starts a member of
#: (:mod:`e31.deployments.members`) by this tag.
MEMBER_TAG = "e31-member:"
#: Seconds before a running job's planned end within which the scheduler hands its resources over to the
#: next job planned on them: that job's flow run is released at once, its flow process starts, stages its
#: inputs and waits (holding nothing) until the job ahead has returned its output; 0 turns it off.
HANDOVER_S = 10.0
#: Tags a node's prefetcher puts on a queued run whose inputs it staged: ``e31-staged`` (what the scheduler's
#: read filters on), ``e31-staged:NODE`` and ``e31-staging-s:SECONDS`` (how long the copy took: the locality wait).
STAGED, STAGED_ON, STAGING_S = "e31-staged", "e31-staged:", "e31-staging-s:"
#: Seconds ahead of now a waiting run's scheduled time is kept at least (Prefect marks runs past
#: their scheduled time Late).
AHEAD_S = 120.0
#: Seconds without a worker heartbeat after which its node counts as lost.
LEASE_S = 60.0
#: Id prefix of the stand-in job that holds a node whose worker is not answering.
DOWN = "~down~"
#: Id prefix of the stand-in job that holds a fenced node: a run lost there may still have processes on it
#: (:mod:`e31.tasks.supervisor.fence`), until its worker or its own flow process says they are gone.
FENCED = "~fenced~"
#: Seconds a crash is left to settle (the worker and Prefect's crash handling report it) before a requeue; until
#: then the crashed run holds its node (its worker may yet hold it Pending to finish a cut return).
SETTLE_S = 3.0


def work_pool_name(pool: PoolSpec) -> str:
    """The Prefect work pool of an E31 pool (its ``name``)."""
    return pool.name


def deployment_name(pool: PoolSpec | str) -> str:
    """The deployment name (under the ``e31-job`` flow) that ``e31 submit``
    creates runs of, for a pool (or its name: its work pool's)."""
    return f"queue-{pool if isinstance(pool, str) else pool.name}"


def nodes_of(pool: PoolSpec) -> list[Node]:
    """The planner's nodes of a pool declaration (``count`` expanded)."""
    return [Node(name, n.gpus, n.cpus, n.memory, n.gpu_type) for n in pool.nodes for name in n.names()]


def staged_tags(tags: Any) -> tuple[tuple[str, ...], float]:
    """The nodes a run's tags say hold its inputs staged (prefetched), and
    the seconds the slowest of those copies took (0.0: none said)."""
    nodes, seconds = [], 0.0
    for tag in tags or ():
        if tag.startswith(STAGED_ON):
            nodes.append(tag[len(STAGED_ON):])
        elif tag.startswith(STAGING_S):
            try:
                seconds = max(seconds, float(tag[len(STAGING_S):]))
            except ValueError:
                pass
    return tuple(nodes), seconds


def planned_start(run: Any) -> PlannedStart | None:
    """The reserved start of a waiting flow run ``run`` (a Prefect
    ``FlowRun``, or None): the node its ``placement`` says it is planned on
    (:data:`PLANNED_VAR`) and its scheduled time (Unix seconds); None when
    the run is not ``Queued`` or its start is no reservation (an estimate,
    or not planned yet)."""
    state = getattr(run, "state", None)
    if getattr(state, "name", None) != QUEUED:
        return None
    node = record_of(run).planned
    if node is None:
        return None
    at = getattr(run, "next_scheduled_start_time", None) or getattr(getattr(state, "state_details", None),
                                                                       "scheduled_time", None)
    return PlannedStart(node, at.timestamp() if at is not None else None)


def planned_node(run: Any) -> str | None:
    """The node of :func:`planned_start` (None when it has none)."""
    start = planned_start(run)
    return start.node if start is not None else None


def placed_on(tags: Any) -> str | None:
    """The node a placed run's tags (its flow run's ``tags``, or the tag
    names of an event's related resources) say it starts on
    (:data:`PLACED_TAG`); None when they name none."""
    for tag in tags or ():
        if isinstance(tag, str) and tag.startswith(PLACED_TAG):
            return tag[len(PLACED_TAG):] or None
    return None


def member_nodes(tags: Any) -> tuple[str, ...]:
    """The other nodes of a gang its flow run's ``tags`` name (:data:`MEMBER_TAG`), in their order."""
    return tuple(t[len(MEMBER_TAG):] for t in tags or () if isinstance(t, str) and t.startswith(MEMBER_TAG)
                 and len(t) > len(MEMBER_TAG))


def placed_tags(tags: Any, node: str | None, members: tuple[str, ...] = ()) -> list[str]:
    """A flow run's ``tags`` with its :data:`PLACED_TAG` naming ``node``
    (None: naming none) and a :data:`MEMBER_TAG` per node of ``members``
    (a gang's other nodes), its other tags as they are."""
    kept = [t for t in tags or () if not (isinstance(t, str) and t.startswith((PLACED_TAG, MEMBER_TAG)))]
    return kept + ([PLACED_TAG + node] if node else []) + [MEMBER_TAG + m for m in members]


def inputs_key(spec: Any) -> tuple[str, ...]:
    """A job's staged inputs as a key: its ``name``, then the sorted
    ``data[].url`` of its spec (a JobSpec or its JSON form); () when it
    reads nothing.  The name is part of it: a job's copies live in its own
    scratch folder (``<root>/<name>/data``), so only later runs of the same
    job reuse them, not another job reading the same URLs."""
    if isinstance(spec, dict):
        name, data = spec.get("name"), spec.get("data")
    else:
        name, data = spec.name, [d.model_dump() for d in spec.data]
    urls = sorted(str(d.get("url")) for d in data or [] if isinstance(d, dict))
    return (str(name), *urls) if urls else ()



def stored_spec(run: Any) -> Any:
    """The job spec a flow run was submitted with (its ``spec`` parameter), as a ``JobSpec``, validated as
    of the run's creation: a deadline was checked to be in the future when the job was submitted, and one
    that has passed since (the job runs late, or is being stopped) leaves the spec valid, so the run stays
    in the queue's view, holding its node.  Raises :class:`e31.specs.errors.SpecError` for a parameter that
    is not a valid job spec."""
    from e31.specs import JobSpec
    from e31.specs.deadlines import deadlines_as_of

    created = getattr(run, "created", None)
    with deadlines_as_of(created if created is not None and created.tzinfo is not None else None):
        return JobSpec.model_validate((run.parameters or {}).get("spec"))
