"""The lead's side of a gang: its rank-0 rendezvous, published on the flow run before its work starts.

Prefect-aware (it writes the run's label), called by the attempt (:mod:`e31.flows.attempt`) on the node the
placement names first.  See :mod:`e31.flows.gang` for the whole protocol.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from e31.flows.gang.rendezvous import Published, publish, publish_stop
from e31.tasks.placement_record import PlacementRecord
from e31.tasks.work.context import ChildConfig
from e31.tasks.work.rendezvous import PORTS_VAR, free_port, interface_of, own_address, port_range

__all__ = ["lead_child", "placed_nodes", "warn_members"]


def placed_nodes(record: PlacementRecord) -> int:
    """How many nodes the run's placement gives it (1 outside a queue, or for a single-node placement)."""
    return max(1, len(record.nodes))


def lead_child(child: ChildConfig, record: PlacementRecord, run_id: str, attempt: int, resume: int | None,
               stop_at: float, grace_s: float) -> ChildConfig:
    """``child`` as rank 0 of the gang ``record`` places: its address for the peers
    (:func:`e31.tasks.work.rendezvous.own_address`, toward ``PREFECT_API_URL``) and a free port there
    (within ``E31_RENDEZVOUS_PORTS``), published on the flow run ``run_id`` with ``attempt`` (the run's
    ``run_count``), the step it resumes from, its stop time (Unix seconds) and ``grace_s``.  A single-node
    placement returns ``child`` as it is.  Raises ``RendezvousError`` when no port is free, and what the
    Prefect client raises when the label cannot be written (the members could not start)."""
    if len(record.nodes) < 2:
        return child
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    addr = own_address(PREFECT_API_URL.value())
    port = free_port(addr, port_range(os.environ.get(PORTS_VAR)))
    with get_client(sync_client=True) as client:
        publish(client, run_id, Published(attempt, addr, port, resume, stop_at, grace_s))
    return replace(child, master_addr=addr, master_port=port, node_rank=0, nnodes=len(record.nodes),
                   interface=interface_of(addr))


def warn_members(run_id: str | None, reason: str) -> None:
    """The lead's work was just warned to stop (``reason``): when this flow run is a gang, write the stop on
    it for the members (:func:`e31.flows.gang.rendezvous.publish_stop`), in a thread of its own (never
    blocks the supervisor; a write that fails leaves each member to its own stop time, a few seconds
    later).  Each member warns its work within a second of reading it, so no rank is warned before rank 0
    (a work that all-reduces its stop flag then ends on every rank at the step where rank 0 saw it)."""
    import threading

    from prefect.runtime import flow_run

    try:
        record = PlacementRecord.from_parameter((flow_run.parameters or {}).get("placement"))
        attempt = int(flow_run.run_count or 1)
    except Exception:  # not in a flow run
        return
    if run_id is None or len(record.nodes) < 2:
        return

    def write() -> None:
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                publish_stop(client, run_id, attempt, reason)
        except Exception:
            pass

    threading.Thread(target=write, name="e31-warn-members", daemon=True).start()
