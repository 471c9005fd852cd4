"""Names and values the queue's mapping onto Prefect uses: the work pool and
deployment of a pool, the state names, the keys of a run's ``placement``,
and the queue's clock constants (seconds)."""

from __future__ import annotations

import re
from typing import Any

from e31.flows.placement import Node
from e31.specs.pool import PoolSpec
from e31.tasks.supervisor.fence import NODE_VAR as FENCE_NODE_VAR  # the flow process fences on it
from e31.tasks.supervisor.fence import PLACEMENT_PARAM, placement_of  # noqa: F401 (the queue's, defined for the fence)

#: The Prefect worker type of E31 work pools (``e31 worker``, :mod:`e31.deployments.worker`).
WORKER_TYPE = "e31"
#: The state names of a waiting and of a placed run (both of type ``Scheduled``).
QUEUED, PLACED = "Queued", "Placed"
#: The node, GPU devices and CPUs of a placement, and the run's attempt: keys of its ``placement`` parameter
#: (:data:`e31.tasks.supervisor.fence.PLACEMENT_PARAM`, read with :func:`placement_of`).
NODE_VAR, DEVICES_VAR, CPUS_VAR, ATTEMPT_VAR = FENCE_NODE_VAR, "gpu_devices", "cpus", "e31_attempt"
#: The node a waiting run's reserved start is planned on, as its ``Queued`` state message names it
#: (``...; earliest start 02:40 UTC on n1, after job a ends``: e31.flows.placement.reasons): that node's
#: ``e31 worker`` prefetches the run's inputs.  Read with :func:`planned_node`.  It is carried by the message
#: the scheduler writes anyway, not by a ``job_variables`` write: Prefect validates every ``job_variables``
#: PATCH against the work pool's whole variables schema (jsonschema, inside a write transaction), which was
#: the largest single cost of the server under a busy queue (bench_queue, py-spy: 17 % of its busy CPU).
PLANNED_ON = re.compile(r"; earliest start [^;]*? UTC on ([A-Za-z0-9][A-Za-z0-9._-]*)")
#: The node a placed run starts on, as its ``Placed`` state message names it (``starts now on n1, ...``;
#: ``handed over behind a (1f0e2d3c) on n1: ...``: e31.flows.queue.record): a worker told of a placement by
#: the server's events (which carry the message) polls only for its own node's.  Read with :func:`placed_on`.
PLACED_ON = re.compile(r"^(?:starts now|handed over behind .*? \([0-9a-f]{8}\)) on ([A-Za-z0-9][A-Za-z0-9._-]*)[,:]")
#: The run a handed-over run waits behind, in its ``placement``: its flow process starts (and stages its
#: inputs) while that run ends, and its work starts once that run's flow process has ended (see HANDOVER_S).
AFTER_VAR = "e31_after"
#: How many attempts of a run that ran (Prefect counted them in ``run_count``) crashed before their work
#: started (handed over behind another run, lost while they waited): in its ``placement``, carried by each
#: placement the scheduler writes; they use none of its retries.
FREE_VAR = "e31_unstarted"
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


def planned_node(state: Any) -> str | None:
    """The node a waiting run's state (a Prefect ``State``, or None) says
    its reserved start is planned on; None when the run is not ``Queued``
    or its start is no reservation (``estimated start``, the submission's
    message).  See :data:`PLANNED_ON`."""
    message = getattr(state, "message", None) if getattr(state, "name", None) == QUEUED else None
    found = PLANNED_ON.search(message) if message else None
    return found.group(1) if found else None


def placed_on(message: str | None) -> str | None:
    """The node a ``Placed`` state's message (or None) says its run starts
    on; None when it names none (see :data:`PLACED_ON`)."""
    found = PLACED_ON.match(message) if message else None
    return found.group(1) if found else None


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

