"""The lead's side of a gang: its rank-0 rendezvous, published on the flow run before its work starts.

Prefect-aware (it writes the run's label), called by the attempt (:mod:`e31.flows.attempt`) on the node the
placement names first.  See :mod:`e31.flows.gang` for the whole protocol.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import replace

from e31.flows.gang.rendezvous import Published, publish, publish_stop
from e31.tasks.placement_record import PlacementRecord
from e31.tasks.work.context import ChildConfig
from e31.tasks.work.rendezvous import PORTS_VAR, free_port, interface_of, own_address, port_range

__all__ = ["PEER_WAIT_S", "lead_rendezvous", "member_failed", "member_lost", "placed_nodes", "warn_members"]

#: Seconds the lead waits, after its work failed, for every member to say how its own work ended.
PEER_WAIT_S = 8.0


def placed_nodes(record: PlacementRecord) -> int:
    """How many nodes the run's placement gives it (1 outside a queue, or for a single-node placement)."""
    return max(1, len(record.nodes))


#: Flow run id -> the token of its lead's current try (what a stop warning names).
_CURRENT: dict[str, str] = {}


def lead_rendezvous(record: PlacementRecord, run_id: str, attempt: int, stop_at: float,
                    grace_s: float) -> Callable[[ChildConfig, int | None], ChildConfig] | None:
    """For a run the placement ``record`` puts on several nodes: the run task's per-try hook
    (:class:`e31.tasks.run.SupervisorConfig` ``rendezvous``) that makes the work rank 0 -- its address
    for the peers (:func:`e31.tasks.work.rendezvous.own_address`, toward ``PREFECT_API_URL``), a free port
    there (within ``E31_RENDEZVOUS_PORTS``), the interface gloo and NCCL use -- and publishes it on the flow
    run ``run_id`` with its attempt (the run's ``run_count`` as the server has it; ``attempt`` where it has
    none), a new token, the step the try resumes from,
    its stop time (Unix seconds) and ``grace_s``.  None for a single-node placement.  The hook raises
    ``RendezvousError`` when no port is free, and what the Prefect client raises when the label cannot be
    written (the members could not start)."""
    if len(record.nodes) < 2:
        return None
    nodes = len(record.nodes)

    def hook(child: ChildConfig, resume: int | None) -> ChildConfig:
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL

        addr = own_address(PREFECT_API_URL.value())
        port = free_port(addr, port_range(os.environ.get(PORTS_VAR)))
        token = uuid.uuid4().hex[:12]
        with get_client(sync_client=True) as client:
            # the server's run_count now, as the members read it: Prefect's runtime keeps the value read before
            # the flow run entered Running (one less, from the second attempt on)
            current = int(client.read_flow_run(run_id).run_count or attempt)
            publish(client, run_id, Published(current, token, addr, port, resume, stop_at, grace_s))
        _CURRENT[run_id] = token
        return replace(child, master_addr=addr, master_port=port, node_rank=0, nnodes=nodes,
                       interface=interface_of(addr), try_token=token)

    return hook


def warn_members(run_id: str | None, reason: str) -> None:
    """The lead's work was just warned to stop (``reason``): when this flow run is a gang, write the stop of
    its current try on it for the members (:func:`e31.flows.gang.rendezvous.publish_stop`), in a thread of
    its own (never blocks the supervisor; a write that fails leaves each member to its own stop time, a few
    seconds later).  Each member warns its work within a second of reading it, so no rank is warned before
    rank 0 (a work that all-reduces its stop flag then ends on every rank at the step where rank 0 saw it)."""
    import threading

    token = _CURRENT.get(run_id or "")
    if token is None:
        return

    def write() -> None:
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                publish_stop(client, run_id, token, reason)
        except Exception:
            pass

    threading.Thread(target=write, name="e31-warn-members", daemon=True).start()


def _ends(run: object, token: str) -> tuple[list[str], dict[int, int]]:
    """The nodes of ``run``'s placement (rank order) and rank -> exit status of each member whose work of the
    try ``token`` has ended, as written on the run."""
    import json

    from e31.flows.gang.rendezvous import MEMBER_LABEL

    record = PlacementRecord.from_parameter((getattr(run, "parameters", None) or {}).get("placement"))
    ends: dict[int, int] = {}
    for rank in range(1, len(record.nodes)):
        try:
            value = json.loads((getattr(run, "labels", None) or {}).get(f"{MEMBER_LABEL}{rank}"))
            if value["token"] == token:
                ends[rank] = int(value["exit"])
        except (TypeError, ValueError, KeyError):
            continue
    return record.nodes, ends


def _killed(code: int) -> bool:
    """Whether a member's exit status says a signal ended it (negative, or a shell's 128 + N)."""
    return code < 0 or code >= 128


def member_failed(run_id: str | None, run: object | None) -> tuple[bool, str] | None:
    """While the lead's work of the current try runs: ``(lost, why)`` when a member's work of this try has
    already ended with a non-zero exit status as written on ``run`` (the flow run as last read; its member
    could not stage its inputs, its work failed, or it was killed: ``lost`` then), so the lead stops its own
    work rather than wait in a collective or ``init_process_group`` for a peer that never comes; None when no
    member failed, or this run is not a gang.  Never blocks (reads nothing)."""
    token = _CURRENT.get(run_id or "")
    if token is None or run is None:
        return None
    nodes, ends = _ends(run, token)
    failed = {rank: code for rank, code in ends.items() if code != 0}
    if not failed:
        return None
    rank, code = min(failed.items())
    if _killed(code):
        return True, f"member rank {rank} on node {nodes[rank]} was killed (exit status {code})"
    return False, (f"member rank {rank} on node {nodes[rank]} ended with exit status {code} (its lines are in the "
                   "flow run's log)")


def member_lost(run_id: str | None, wait_s: float = PEER_WAIT_S) -> str | None:
    """After the lead's work of the current try failed: why the try is lost, when a member's work ended by
    a signal (kill -9, the OOM killer) or did not say how it ended within ``wait_s`` seconds (its process or
    its node is gone); None when every member's work ended with an exit status of its own (the work
    failed; the lead's failure stands) or this run is not a gang.  Reads the members' ends on the flow run
    (:func:`e31.flows.gang.rendezvous.report_member`)."""
    import time

    from prefect.client.orchestration import get_client

    token = _CURRENT.get(run_id or "")
    if token is None:
        return None
    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while True:
            try:
                run = client.read_flow_run(run_id)
            except Exception:  # the API is away: nothing says a member was lost
                return None
            nodes, ends = _ends(run, token)
            killed = {rank: code for rank, code in ends.items() if _killed(code)}
            if killed:
                rank, code = min(killed.items())
                return f"member rank {rank} on node {nodes[rank]} was killed (exit status {code})"
            missing = [rank for rank in range(1, len(nodes)) if rank not in ends]
            if not missing:
                return None
            if time.monotonic() > deadline:
                return (f"member rank {missing[0]} on node {nodes[missing[0]]} did not say how its work "
                        f"ended within {wait_s:g} s (its process or its node is gone)")
            time.sleep(0.5)
