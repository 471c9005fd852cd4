"""Fencing: a flow process whose run was placed on another node stops, and
writes nothing more.

A node whose worker stops answering past the lease is taken for lost: the
scheduler marks its runs ``Crashed`` and queues them again (retries left),
then places them on another node.  A flow process on the lost node may
still live (only its worker died, or the machine was cut off and comes
back): left alone it would run beside the new attempt, upload checkpoints
into the same folder and return its output over the new attempt's, the
last return winning.  So each flow process compares the node its run is
placed on now (``e31_node`` in the run's ``placement`` parameter,
:func:`placement_of`, read by the cancel watcher's reader every 10 s under
a worker) with its own (``E31_NODE``, set by its worker): once the run
names another node, the process kills its work and ends with exit status 0 and no state written (the run's state is the new
attempt's), before any return begins.  A return already under way is left
to end (it is bounded; the new attempt's return, after its own work,
comes later and replaces it whole: each manifest names its ``attempt``);
the process then reads its run once more before its end, and steps aside
rather than end the run that is now the other node's.

A run placed back on the same node is not fenced: its second flow process
finds the job's lock held by the first and leaves the run to it
(``e31.flows.job``).  Outside a queue (no ``E31_NODE``) nothing is fenced.
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: The flow run parameter holding a run's placement (the E31 scheduler writes it; the worker and this fence
#: read it): a dict with ``e31_node``, ``gpu_devices``, ``cpus``, ``e31_attempt`` and, for a run handed over
#: behind another, ``e31_after``.  A parameter rather than ``job_variables``: Prefect's ``PATCH /flow_runs/{id}``
#: with ``job_variables`` reads the run and its deployment and validates them against the work pool's schema
#: inside its write transaction (83 ms of server CPU against 8 for a plain update, and on SQLite a write
#: committed meanwhile fails it with 503: sent 3.3 times per job under load; tests/benchmarks/bench_api_costs.py).
PLACEMENT_PARAM = "placement"
#: The placement's key of the node a run is placed on (the scheduler writes it; the worker reads it).
NODE_VAR = "e31_node"
#: The environment variable naming the node a flow process runs on (set by ``e31 worker``).
NODE_ENV = "E31_NODE"


def this_node() -> str | None:
    """The node this flow process runs on (``E31_NODE``), or None outside a queue."""
    return os.environ.get(NODE_ENV) or None


def placement_of(run: Any) -> dict[str, Any]:
    """The placement recorded on the flow run ``run`` (a Prefect ``FlowRun``,
    or anything with ``parameters`` and ``job_variables``): its
    :data:`PLACEMENT_PARAM` parameter (a dict, see there), unless that names
    no node and the ``job_variables`` do (a run placed by an E31 before
    December 2026, or given a node by hand, maybe after a requeue wrote the
    parameter without one); else ``{}``."""
    placed = (getattr(run, "parameters", None) or {}).get(PLACEMENT_PARAM)
    variables = getattr(run, "job_variables", None) or {}
    if isinstance(placed, dict) and (placed.get(NODE_VAR) or not variables.get(NODE_VAR)):
        return placed
    return variables


def placed_elsewhere(run: Any, node: str | None) -> str | None:
    """The node the flow run ``run`` (a Prefect ``FlowRun``) is placed on now
    when that is another node than ``node``; None when it is ``node``, is
    not placed (queued again, not yet placed), or ``node`` is None."""
    if node is None:
        return None
    placed = placement_of(run).get(NODE_VAR)
    return placed if isinstance(placed, str) and placed and placed != node else None


def moved_now(run_id: str | None) -> str | None:
    """One read of the flow run now: the other node it is placed on, or
    None (not placed elsewhere, outside a queue, no run id, or the API did
    not answer)."""
    node = this_node()
    if node is None or run_id is None:
        return None
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return placed_elsewhere(client.read_flow_run(run_id), node)
    except Exception:
        return None


def superseded_message(run_id: str | None, node: str | None, moved_to: str) -> str:
    """The log line of a flow process that steps aside."""
    return (f"flow run {run_id} was placed on node {moved_to} after node {node} was taken for lost; this flow "
            f"process on {node} stops its work and returns nothing: the run, its checkpoints and its output are "
            f"the attempt on {moved_to}'s")


def step_aside(run_id: str | None, moved_to: str) -> None:
    """End this flow process at once, with exit status 0 and no state
    written, after logging :func:`superseded_message` (to the run's log
    through the API, and to stderr; stderr alone outside a run).  The caller has ended the work's
    processes.  Never returns."""
    line = superseded_message(run_id, this_node(), moved_to)
    try:
        from prefect import get_run_logger
        from prefect.logging.handlers import APILogWorker

        get_run_logger().warning("%s", line)  # (Prefect's console handler prints it on stderr too)
        APILogWorker.drain_all(timeout=5)  # sent before the exit, which drops what is still queued
    except Exception:  # no run context, or no API: stderr only
        try:
            print(f"e31: {line}", file=sys.stderr, flush=True)
        except OSError:  # a stream with no reader left
            pass
    os._exit(0)
