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
(``e31.flows.attempt``).  Outside a queue (no ``E31_NODE``) nothing is fenced.

A run's devices are free only once its processes are gone.  When the
scheduler takes a node for lost it first writes a *fence* for each of the
node's runs (a Prefect Variable per run and node, :func:`fence_name`, holding
:func:`fence_value`), then marks the run ``Crashed``.  While a fence names a
node, the scheduler places nothing new on that node, and the run's requeued
attempt does not start elsewhere.  The fence is lifted (its variable
deleted) by whoever can say that no process of the lost attempt remains:
the flow process itself, once it sees its run ``Crashed``, ended or queued
again (:func:`superseded`; it kills its work first, then
:func:`step_aside` lifts the fence), or the node's ``e31 worker`` when it
starts or is heard again (it kills the run's processes first:
:func:`e31.deployments.leftovers.clear_fences`).  An operator who knows the
machine is off declares it down (``e31 node NODE --down``: ``down`` in the
fence): the requeued attempt may then start elsewhere, and the node itself
stays fenced until its worker confirms.  A silent machine promises nothing
(as Kubernetes does not delete a pod of an unreachable node until its
kubelet or an operator confirms it is gone), so without one of these the
run's attempt elsewhere waits.
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


#: Prefix of the Prefect Variables that fence a lost run's node (one per run and node: :func:`fence_name`).
FENCE_PREFIX = "e31-fence-"
#: What :func:`superseded` answers, before the state's name, when the run is no longer this process's to run
#: on this node (ended, crashed, queued again), as opposed to placed on another node (the node's name).
ENDED_MARK = "~ended~"


def fence_name(run_id: str, node: str) -> str:
    """The Prefect Variable fencing ``node`` for the lost flow run
    ``run_id``: ``e31-fence-<run id>-<node key>``, the node key being the
    first 12 hex digits of the SHA-256 of the node's name (a Variable name
    takes lowercase letters, digits, ``-`` and ``_`` only; a node's name
    may hold capitals and dots).  One per run *and* node: a run lost on n1
    (declared down, its fence kept until n1's worker confirms) and lost
    again on n2 has both nodes fenced, and a process on one node lifts
    only its own node's fence."""
    import hashlib

    return f"{FENCE_PREFIX}{str(run_id).lower()}-{hashlib.sha256(node.encode()).hexdigest()[:12]}"


def fence_value(pool: str, node: str, run_id: str, job: str | None, since: float) -> dict[str, Any]:
    """A fence's value: the ``pool`` and ``node`` it holds, the lost flow
    run (``run``) and its ``job`` name, ``since`` (Unix seconds: when the
    node was taken for lost) and ``down`` (False until an operator declares
    the node down: ``e31 node NODE --down``)."""
    return {"pool": pool, "node": node, "run": str(run_id), "job": job, "since": since, "down": False}


#: Variables read per page of ``POST /variables/filter`` (Prefect's largest page is 200).
PAGE = 200


def read_fences(client: Any, pool: str) -> dict[str, dict[str, Any]]:
    """Variable name -> fence value (see :func:`fence_value`) of every
    fence of the pool named ``pool``, all pages of them; ``client``:
    Prefect's sync client.  Raises what the API raises (a caller that
    cannot read them must not take the nodes for free)."""
    found: list = []
    while True:
        page = client.request("POST", "/variables/filter", json={
            "variables": {"name": {"like_": FENCE_PREFIX}}, "sort": "NAME_ASC", "limit": PAGE,
            "offset": len(found)}).json() or []
        found += page
        if len(page) < PAGE:
            return _fences_of(found, pool)


async def read_fences_async(client: Any, pool: str) -> dict[str, dict[str, Any]]:
    """:func:`read_fences` with Prefect's async client."""
    found: list = []
    while True:
        page = (await client.request("POST", "/variables/filter", json={
            "variables": {"name": {"like_": FENCE_PREFIX}}, "sort": "NAME_ASC", "limit": PAGE,
            "offset": len(found)})).json() or []
        found += page
        if len(page) < PAGE:
            return _fences_of(found, pool)


def _fences_of(found: Any, pool: str) -> dict[str, dict[str, Any]]:
    fences = {}
    for variable in found or ():
        value = variable.get("value") if isinstance(variable, dict) else None
        if isinstance(variable, dict) and str(variable.get("name", "")).startswith(FENCE_PREFIX) and \
                isinstance(value, dict) and value.get("pool") == pool and isinstance(value.get("node"), str):
            fences[str(variable["name"])] = value
    return fences


def fences_of_run(fences: dict[str, dict[str, Any]], run_id: str) -> list[dict[str, Any]]:
    """The values of ``fences`` (as :func:`read_fences` answers) that fence the flow run ``run_id``."""
    return [f for f in fences.values() if str(f.get("run")) == str(run_id)]


def lift_fence(run_id: str | None, node: str | None = None) -> bool:
    """Delete the fence of the flow run ``run_id`` on ``node`` (default:
    this process's node, :func:`this_node`): this process has ended the
    run's work on that machine.  True when the API answered (a run with no
    fence counts).  Best effort: False on any error."""
    node = node or this_node()
    if not run_id or not node:
        return False
    try:
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound

        with get_client(sync_client=True) as client:
            try:
                client.delete_variable_by_name(fence_name(run_id, node))
            except ObjectNotFound:
                pass
        return True
    except Exception:
        return False


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


def superseded(run: Any, node: str | None) -> str | None:
    """Why the flow process of ``run`` (a Prefect ``FlowRun``) on ``node``
    must stop its work and write nothing more: the other node the run is
    placed on now (:func:`placed_elsewhere`), or :data:`ENDED_MARK` and the
    name of its state when that state is ``Crashed``, ``Completed``,
    ``Failed`` or ``Scheduled`` (its node was taken for lost: the scheduler
    crashed it and may have queued it again; or someone ended it by hand):
    a run whose state says it runs nowhere must not run on unattended, on
    devices the queue may give to other work.  None while the run is this
    node's and ``Pending``/``Running`` (``Cancelling`` and ``Cancelled``
    are a cancel's: :mod:`e31.tasks.supervisor.cancel`), or ``node`` is None."""
    if node is None:
        return None
    elsewhere = placed_elsewhere(run, node)
    if elsewhere is not None:
        return elsewhere
    state = getattr(run, "state", None)
    kind = getattr(getattr(state, "type", None), "value", None)
    if kind in ("CRASHED", "COMPLETED", "FAILED", "SCHEDULED"):
        return f"{ENDED_MARK}{state.name or kind.title()}"
    return None


def moved_now(run_id: str | None) -> str | None:
    """One read of the flow run now: why this process must step aside
    (:func:`superseded`), or None (still this node's, outside a queue, no
    run id, or the API did not answer)."""
    node = this_node()
    if node is None or run_id is None:
        return None
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return superseded(client.read_flow_run(run_id), node)
    except Exception:
        return None


def superseded_message(run_id: str | None, node: str | None, moved_to: str) -> str:
    """The log line of a flow process that steps aside (``moved_to``: what
    :func:`superseded` answered)."""
    if moved_to.startswith(ENDED_MARK):
        return (f"flow run {run_id} is {moved_to[len(ENDED_MARK):]} while this flow process on node {node} still ran "
                "it (its node was taken for lost, or it was ended by hand); this process stops its work and returns "
                "nothing, and says its processes are gone so the node's devices can be given to other work")
    return (f"flow run {run_id} was placed on node {moved_to} after node {node} was taken for lost; this flow "
            f"process on {node} stops its work and returns nothing: the run, its checkpoints and its output are "
            f"the attempt on {moved_to}'s")


def step_aside(run_id: str | None, moved_to: str) -> None:
    """End this flow process at once, with exit status 0 and no state
    written, after logging :func:`superseded_message` (to the run's log
    through the API, and to stderr; stderr alone outside a run) and lifting
    the run's fence (:func:`lift_fence`: its work is gone from this node).
    The caller has ended the work's processes.  Never returns."""
    line = superseded_message(run_id, this_node(), moved_to)
    lift_fence(run_id)
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
