"""Tell the workers which node a run was placed on, in an event of its own.

A worker polls the server at once when a run is placed on its node
(:func:`e31.deployments.runevents.poll_on_placements`).  The server's own
``prefect.flow-run.Placed`` event cannot say which node: the related
resources it carries (the run's tags, where the scheduler writes
``e31-placed:<node>``) are the server's copy as of the run's first event,
kept for ``PREFECT_API_EVENTS_RELATED_RESOURCE_CACHE_TTL`` (5 minutes by
default; ``prefect/server/models/events.py``), so every worker polled on
every placement.  The scheduler therefore sends, once a ``Placed`` state is
written, a custom event (Prefect's ``emit_event``, its documented way to
send one) named :data:`PLACED_EVENT` about the flow run, with the node in
the resource's label :data:`NODE_LABEL` and the run's work pool as a
related resource (the workers' subscription filters by it).

An event that cannot be sent (the work pool cannot be read, no events
client) is skipped: the run's worker takes it at its next quiet poll
(:data:`e31.deployments.runevents.QUIET_POLL_S`).
"""

from __future__ import annotations

import logging
from typing import Any

#: The event a placement is announced with.
PLACED_EVENT = "e31.flow-run.placed"
#: The resource label naming the node the run was placed on.
NODE_LABEL = "e31.node"
#: The resource label naming a multi-node run's other nodes, comma-separated (absent for one node): their
#: workers start its members at once (:mod:`e31.deployments.members`).
MEMBERS_LABEL = "e31.members"

_log = logging.getLogger("e31.queue")
#: Seconds a work pool's id is kept before it is read again (a pool deleted and created again has a new one).
POOL_ID_KEPT_S = 60.0
_pool_ids: dict[str, tuple[str, float]] = {}  # work pool name -> (its id, time.monotonic() when read)


def announce_placed(client: Any, work_pool: str, flow_run_id: str, node: str | None,
                    members: tuple[str, ...] = ()) -> bool:
    """Send :data:`PLACED_EVENT` for the flow run ``flow_run_id`` placed on
    ``node`` (None: a node not known here; every worker then polls) and,
    for a gang, ``members`` (its other nodes) of the
    work pool named ``work_pool``; ``client``: a sync Prefect client (for the
    work pool's id, read again after :data:`POOL_ID_KEPT_S`).  True when the
    event was handed to Prefect's events worker (which sends it in the
    background)."""
    import time

    from prefect.events import emit_event

    try:
        pool_id, read_at = _pool_ids.get(work_pool, (None, 0.0))
        if pool_id is None or time.monotonic() - read_at > POOL_ID_KEPT_S:
            pool_id = str(client.read_work_pool(work_pool).id)
            _pool_ids[work_pool] = (pool_id, time.monotonic())
        resource = {"prefect.resource.id": f"prefect.flow-run.{flow_run_id}"}
        if node:
            resource[NODE_LABEL] = node
        if members:
            resource[MEMBERS_LABEL] = ",".join(members)
        return emit_event(PLACED_EVENT, resource=resource, related=[
            {"prefect.resource.id": f"prefect.work-pool.{pool_id}", "prefect.resource.role": "work-pool"}]) is not None
    except Exception as exc:  # the run is taken at its worker's next quiet poll
        _log.debug("placement of %s not announced: %s: %s", flow_run_id, type(exc).__name__, exc)
        return False
