"""Read a pool's flow runs as planner input (:class:`Snapshot`): the runs
that hold resources, the queued ones, and the lost, crashed and blocked."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from e31.flows.placement import Node, QueuedJob, RunningJob
from e31.flows.placement.estimates import estimate_runtime
from e31.prefect_compat.clock import server_now
from e31.flows.queue.overheads import from_run
from e31.flows.queue.cache import RunCache, read_active
from e31.flows.queue.corrections import chain_handovers, clip_overbooked, one_run_per_job
from e31.flows.queue.pace import WRITTEN
from e31.flows.queue.preempt import (hold_behind_victims, is_preempted, preempted_then_lost, queued_fields,
                                     victim_fields, waiting)
from e31.flows.queue.mapping import stored_spec
from e31.flows.queue.mapping import (CPUS_VAR, DEVICES_VAR, DOWN, FENCED, FREE_VAR, LEASE_S, NODE_VAR,
                                     PLACED, QUEUED, SETTLE_S, inputs_key, nodes_of, placement_of, planned_node,
                                     record_of, staged_tags, work_pool_name)
from e31.specs import JobSpec
from e31.specs.pool import PoolSpec
# the name of the Pending state a worker holds a run in while it finishes a return its flow process cut
from e31.states import RETURNING
from e31.tasks.supervisor.marks import work_never_started
from e31.tasks.supervisor.fence import fences_of_run


@dataclass
class Snapshot:
    """The pool's flow runs as planner input at ``now`` (Unix seconds).

    ``runs``: flow run id -> flow run; ``specs``: id -> the job spec (parsed
    from its ``spec`` parameter); ``running``/``queued``: planner input;
    ``bad``: id -> why a run cannot be planned (an unreadable spec);
    ``lost``: ids of runs holding resources on a node whose worker stopped
    answering; ``requeue``: ids of crashed runs that have retries left;
    ``blocked``: id -> why a queued run is held back from the plan (another
    run of the same job is running or queued ahead: one run of a job at a
    time, as its scratch folder and destination are the job's); ``behind``:
    id of a handed-over run -> id of the run it waits behind (its flow
    process runs, its work has not started: see
    :data:`e31.flows.queue.mapping.HANDOVER_S`).  A run behind another holds
    nothing of its own: the planner sees the run ahead holding its
    resources until its planned end plus the handed-over run's estimate.
    ``heard``: node -> its worker's last heartbeat (Unix seconds).
    ``fences``: fence Variable name -> its value (a run lost with a node whose
    processes may remain there: :mod:`e31.tasks.supervisor.fence`); a
    fenced node is held whole by a stand-in job (``~fenced~NODE``) and a
    fenced run that was queued again is ``blocked`` until its fence is
    lifted or its node declared down."""

    now: float
    nodes: list[Node]
    runs: dict[str, Any] = field(default_factory=dict)
    specs: dict[str, JobSpec] = field(default_factory=dict)
    running: list[RunningJob] = field(default_factory=list)
    queued: list[QueuedJob] = field(default_factory=list)
    bad: dict[str, str] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    #: Run id of ``lost`` -> the node it was lost with (a gang's: the first of its nodes that stopped answering).
    lost_on: dict[str, str] = field(default_factory=dict)
    requeue: list[str] = field(default_factory=list)
    blocked: dict[str, str] = field(default_factory=dict)
    behind: dict[str, str] = field(default_factory=dict)
    #: Ids of preempted runs that returned their output (``Cancelled`` named ``Preempted``): queued again.
    preempted: list[str] = field(default_factory=list)
    #: Ids of runs cancelled while queued after an earlier attempt (``Cancelling``, placed nowhere): no process
    #: of theirs exists to end the cancel, so the queue makes them ``Cancelled``.
    unplaced_cancels: list[str] = field(default_factory=list)
    #: The pool's tenants with their usage (:mod:`e31.flows.queue.usage`), when the pool declares tenants; the
    #: planner then orders and bounds by them.
    tenancy: Any = None
    #: Ids of queued runs beyond their tenant's quota (they borrow), as the tick's plan ordered them: never
    #: handed over ahead of a node's release (:func:`e31.flows.queue.record.handover_lead`).
    borrowing: set = field(default_factory=set)
    #: What a waiting deadline job's reason adds about the preemption it waits for (flow run id -> words;
    #: :func:`e31.flows.queue.preempt.plan` fills it)
    preempt_notes: dict[str, str] = field(default_factory=dict)
    lease_s: float = LEASE_S
    #: Node name -> the last heartbeat of its worker (Unix seconds), for every worker the work pool knows.
    heard: dict[str, float] = field(default_factory=dict)
    #: The nodes whose ``e31 worker`` prefetches the inputs of runs planned on them (a ``scratch_budget`` in the
    #: pool file); None: not known, every node counts.
    prefetching: frozenset[str] | None = None
    #: Whether ``lease_s`` is the live scheduler's (``e31 queue`` read it: :func:`e31.deployments.presence.lease_of`).
    scheduler_heard: bool = False
    #: Node name -> what its runs hold beyond what it has (see :func:`e31.flows.queue.corrections.clip_overbooked`); empty when none does.
    overbooked: dict[str, str] = field(default_factory=dict)
    #: The pool's name (its fences name it).
    pool: str = ""
    #: Fence Variable name -> its value (:func:`e31.tasks.supervisor.fence.fence_value`): one per lost run and node.
    fences: dict[str, dict] = field(default_factory=dict)



_SPECS: dict[str, JobSpec] = {}  # flow run id -> parsed spec (a run's parameters never change)


def _spec(run: Any) -> JobSpec:
    key = str(run.id)
    if key not in _SPECS:
        _SPECS[key] = stored_spec(run)  # as of its submission: a deadline passed since keeps it in view
    return _SPECS[key]


def _ts(value: Any) -> float | None:
    return value.timestamp() if value is not None else None


def _deadline(spec: JobSpec, start: datetime) -> float | None:
    from e31.flows.compile import resolve_deadline

    deadline, _ = resolve_deadline(spec, start)
    return deadline.timestamp() if deadline else None


def attempt_start(run: Any) -> float | None:
    """When the current attempt of the flow run ``run`` started (Unix
    seconds on the server's clock; None when its state has no time).
    Prefect's ``start_time`` is the first attempt's: a run queued again
    after a crash and placed anew (``Placed``, ``Pending``, or ``Running``
    with ``run_count`` 2+) starts its attempt at its current state's time,
    else the planner would plan it as ending a whole attempt early (its
    planned end past, the next job handed over behind it at once).  A
    first attempt that runs (``Running``, ``Cancelling``, or a fresh
    ``Crashed``) keeps ``start_time``, and so does a run held ``Pending``
    while its worker finishes a cut return (:data:`RETURNING`: its work
    has ended; its state's time is the return's)."""
    state = run.state
    if state is None:
        return _ts(run.start_time)
    kind, count = state.type.value, run.run_count or 0
    anew = kind == "SCHEDULED" or (kind == "PENDING" and state.name != RETURNING) or (kind == "RUNNING" and count > 1)
    return (None if anew else _ts(run.start_time)) or _ts(state.timestamp)


def heard(client: Any, pool: PoolSpec) -> dict[str, float]:
    """Node name -> the last heartbeat (Unix seconds) of its ``e31 worker``
    (a worker is named after its node), for every worker the work pool
    knows, however long silent."""
    from prefect.exceptions import ObjectNotFound

    found: dict[str, float] = {}
    try:
        workers = client.read_workers_for_work_pool(work_pool_name(pool))
    except ObjectNotFound:  # no job submitted to the pool yet, no scheduler or worker started: no work pool
        return found
    except Exception as exc:  # the sync client answers a missing work pool with the HTTP error itself
        if getattr(getattr(exc, "response", None), "status_code", None) == 404:
            return found
        raise
    for worker in workers:
        beat = _ts(worker.last_heartbeat_time)
        if beat is not None:
            found[worker.name] = max(beat, found.get(worker.name, 0.0))
    return found


def live_nodes(client: Any, pool: PoolSpec, now: float, lease_s: float = LEASE_S,
               beats: dict[str, float] | None = None) -> dict[str, float]:
    """Node name -> the last heartbeat (Unix seconds) of its ``e31 worker``,
    for workers heard from within ``lease_s`` seconds (``beats``: what
    :func:`heard` answered, else read now)."""
    beats = heard(client, pool) if beats is None else beats
    return {node: beat for node, beat in beats.items() if now - beat <= lease_s}


def read_fences(client: Any, pool: PoolSpec, cache: RunCache | None = None) -> dict[str, dict]:
    """The pool's fences (:func:`e31.tasks.supervisor.fence.read_fences`).
    With a ``cache``, read only while some may exist: at a full read of the
    runs, and while the last read found one or a tick took a node for lost
    (only the scheduler writes them); else the cache's answer is kept."""
    from e31.tasks.supervisor.fence import read_fences as read_them

    if cache is None:
        return read_them(client, pool.name)
    if cache.fences is None or cache.fences or cache.fences_at != cache.full_reads:
        cache.fences, cache.fences_at = read_them(client, pool.name), cache.full_reads
    return cache.fences


def read(client: Any, pool: PoolSpec, now: float | None = None, history: dict[str, list[float]] | None = None,
         lease_s: float = LEASE_S, staged: dict[tuple[str, ...], list[str]] | None = None,
         cache: RunCache | None = None, returns: dict[str, float] | None = None) -> Snapshot:
    """Read every non-final flow run of the pool's work pool (and crashed ones
    that may be retried) as planner input.  ``history``: job name -> past run
    times in seconds (for jobs without a ``duration``); ``returns``: job name
    -> seconds its output's return takes (:mod:`e31.flows.queue.overheads`;
    counted in the time a job holds its node, unless its estimate comes from
    its past runs, whose time includes it); ``staged``: inputs
    key -> nodes holding those inputs staged (data locality); ``cache``: the
    runs kept since the last read, brought up to date (else all are read).
    With a ``cache``, the runs of a node whose worker is silent past the
    lease are ``lost`` only once it has stayed so for
    :data:`e31.flows.queue.cache.LOST_CONFIRM_S` seconds (after the API
    itself stopped answering, every heartbeat looks old until the workers
    are heard from again); meanwhile they keep their resources and the node
    takes nothing new."""
    from prefect.client.schemas.objects import StateType

    now = server_now() if now is None else now  # server timestamps are judged on the server's clock
    snap = Snapshot(now=now, nodes=nodes_of(pool), lease_s=lease_s, pool=pool.name,
                    prefetching=frozenset(name for n in pool.nodes if n.scratch_budget for name in n.names()))
    snap.heard = heard(client, pool)
    alive = live_nodes(client, pool, now, lease_s, snap.heard)
    runs = cache.read(client, now) if cache is not None else \
        read_active(client, pool)
    known = {n.name for n in snap.nodes}
    silent = known - set(alive)
    reserve = _return_reserve_s()
    lost_nodes = cache.confirm_lost(silent) if cache is not None else silent
    snap.fences = read_fences(client, pool, cache)
    fenced = {f["node"] for f in snap.fences.values() if f["node"] in known}
    start_s = cache.overheads.start_s_most() if cache is not None else 0.0  # placement to Running, measured
    for run in runs:
        key = str(run.id)
        snap.runs[key] = run
        try:
            spec = _spec(run)
        except Exception as exc:  # not an E31 job spec: cannot be planned
            snap.bad[key] = f"its spec parameter is not a valid job spec ({type(exc).__name__})"
            continue
        snap.specs[key] = spec
        state, variables = run.state, placement_of(run)
        node = variables.get(NODE_VAR)
        if cache is not None:
            cache.overheads.saw(key, *from_run(run), node)
        req = spec.request
        gang = record_of(run).gang
        if is_preempted(run):  # its output is returned: the queue takes it back (e31.flows.queue.preempt)
            snap.preempted.append(key)
            continue
        crashed = state.type == StateType.CRASHED
        if crashed:
            settled = now - (_ts(state.timestamp) or now) >= SETTLE_S  # the worker may still be reporting the crash
            # a gang's run crashed with any of its nodes lost is settled there: its other nodes answer, and
            # counting it as holding them would crash it again every tick (its crash would never settle)
            if settled or any(n in lost_nodes for n in (node, *(member for member, _ in gang))):
                # run_count: the attempts that ran, less those that crashed before their work started
                if settled and (work_never_started(run) or retries_used(run) <= req.retries):
                    snap.requeue.append(key)
                continue
            # Not settled: Prefect's worker reports a flow process that exited non-zero as Crashed a moment before
            # the e31 worker holds the run Pending ('Returning') to finish a return it cut; the node stays its own
        holding = crashed or state.type in (StateType.PENDING, StateType.RUNNING, StateType.CANCELLING) or \
            (state.type == StateType.SCHEDULED and state.name == PLACED)
        if state.type == StateType.CANCELLING and (node is None or _cancelled_unstarted(run, now)):
            # cancelled while queued or placed after an earlier attempt (a crash, a preemption): the server lets
            # such a run be Cancelling (its last attempt left an infrastructure pid) and no process of it exists
            # to end it
            snap.unplaced_cancels.append(key)
            continue
        if holding:
            if node not in known or any(member not in known for member, _ in gang):
                continue
            gone = [n for n in (node, *(member for member, _ in gang)) if n in lost_nodes]
            if gone:  # one lost node ends a gang
                snap.lost.append(key)
                snap.lost_on[key] = gone[0]
                continue
            start = attempt_start(run) or now
            estimate = estimate_runtime(_secs(req.duration), _secs(req.limit or req.duration),
                                        (history or {}).get(spec.name, ()))
            snap.running.append(RunningJob(
                id=key, node=node, devices=tuple(int(d) for d in variables.get(DEVICES_VAR) or ()),
                cpus=int(variables.get(CPUS_VAR) or req.cpus), memory=req.memory or 0,
                start=start, expected_end=start + estimate.runtime_s + _output_s(returns, spec.name, estimate),
                gang=gang, **victim_fields(spec, run, waiting(run))))
            continue
        due = state.name == QUEUED or (_ts(run.expected_start_time) or now) <= now
        if state.type == StateType.SCHEDULED and due:
            prefetched, wait_s = staged_tags(run.tags)  # inputs a node's prefetcher staged for this run
            # a run of a deployment's schedule was submitted at its scheduled time (Prefect's expected_start_time,
            # set once), though made days ahead and Queued since: its creation would age it and start its
            # deadline_within days early; e31 submit's runs are scheduled AHEAD_S after their creation
            submitted = _ts(run.expected_start_time) if getattr(run, "auto_scheduled", False) or state.name != QUEUED \
                else _ts(run.created)
            # kept even when a moment ahead of server_now() (an estimate from whole-second Date headers):
            # runs submitted within that moment, clamped to now, would tie and be ordered by their random ids
            submitted = now if submitted is None else submitted
            estimate = estimate_runtime(_secs(req.duration), _secs(req.limit or req.duration),
                                        (history or {}).get(spec.name, ()))
            snap.queued.append(QueuedJob(
                id=key, name=spec.name, gpus=req.gpus, cpus=req.cpus, memory=req.memory or 0, nodes=req.nodes,
                gpu_type=getattr(req, "gpu_type", None), submitted=submitted,
                deadline=_deadline(spec, datetime.fromtimestamp(submitted, timezone.utc)),
                runtime_s=estimate.runtime_s, limit_s=_secs(req.limit or req.duration) or estimate.runtime_s,
                runtime_source=estimate.source, runtime_note=estimate.note,
                preferred_nodes=tuple(dict.fromkeys(n for n in (*prefetched, *(staged or {}).get(inputs_key(spec), ()))
                                                    if n in known)),
                locality_wait_s=wait_s, planned_node=_planned(run), return_s=reserve,
                start_s=start_s, output_s=_output_s(returns, spec.name, estimate), **queued_fields(spec, run)))
    for job in list(snap.queued):  # its attempt on a lost node may still run: not a second one beside it
        fence = next((f for f in fences_of_run(snap.fences, job.id) if not f.get("down")), None)
        if fence is not None:
            snap.blocked[job.id] = _fence_wait(fence)
    snap.queued = [j for j in snap.queued if j.id not in snap.blocked]
    if cache is not None and snap.lost:
        cache.fences = None  # the tick fences their nodes: the next one reads the fences
    chain_handovers(snap, cache.ended_at if cache is not None else {})
    hold_behind_victims(snap)
    one_run_per_job(snap)
    clip_overbooked(snap)
    for node in snap.nodes:  # a node without a live worker takes nothing: what its runs leave is held
        # until its worker answers (all of it once they are lost); a fenced node, until its lost runs' processes
        # are said to be gone (the whole node: a silent machine's state is unknown, and its worker clears the
        # fence as it starts, before the node could take anything)
        if node.name not in alive or node.name in fenced:
            held = [(r, devices) for r in snap.running for name, devices in r.parts if name == node.name]
            snap.running.append(RunningJob(
                id=f"{FENCED if node.name in fenced else DOWN}{node.name}", node=node.name,
                devices=tuple(d for d in range(node.gpus) if not any(d in devices for _, devices in held)),
                cpus=max(0, node.cpus - sum(r.cpus for r, _ in held)),
                memory=max(0, node.memory - sum(r.memory for r, _ in held)), start=now, expected_end=now + lease_s))
    return snap


def _planned(run: Any) -> str | None:
    """The node a waiting run's reserved start was planned on by the last
    plan written: as this scheduler wrote it (:data:`e31.flows.queue.pace.WRITTEN`),
    else as its ``placement`` records it (:func:`e31.flows.queue.mapping.planned_start`;
    kept there where a node of the pool prefetches)."""
    known, node = WRITTEN.planned(run)
    return node if known else planned_node(run)


#: Seconds a run ``Cancelling`` since before its placed attempt started is left to its worker (a flow process
#: started meanwhile is stopped by the worker's runner, which ends the run ``Cancelled``) before the scheduler
#: ends it: a process starts and enters ``Running`` in a few seconds, also on a loaded machine.
UNSTARTED_CANCEL_S = 15.0


def _cancelled_unstarted(run: Any, now: float) -> bool:
    """Whether ``run``, ``Cancelling``, was cancelled while placed for an attempt that never entered
    ``Running`` (its ``run_count`` is still the one its placement record counted), at least
    :data:`UNSTARTED_CANCEL_S` ago.  A run queued again after an earlier attempt keeps that attempt's
    infrastructure pid, so the server does not end such a cancel itself, and no process of it exists to."""
    from e31.tasks.placement_record import record_of

    record = record_of(run)
    if not run.run_count or record.attempt is None or run.run_count > record.attempt:
        return False
    return now - (_ts(run.state.timestamp) or now) >= UNSTARTED_CANCEL_S


def unstarted_of(run: Any) -> int:
    """How many earlier attempts of ``run`` that Prefect counted in its
    ``run_count`` crashed before their work started (:data:`FREE_VAR` in its
    placement; 0 when absent or not a count)."""
    value = placement_of(run).get(FREE_VAR, 0)
    return value if isinstance(value, int) and value > 0 else 0


def retries_used(run: Any) -> int:
    """How many of its retries the flow run ``run`` has used: Prefect's
    ``run_count`` less its attempts that crashed before their work started
    and those the queue preempted (neither counts), including one lost with
    its node while it was being preempted."""
    lost = 1 if preempted_then_lost(run.state) else 0  # its preemption, not yet in its record
    return (run.run_count or 0) - unstarted_of(run) - len(record_of(run).preempted) - lost


def _fence_wait(fence: dict) -> str:
    """Why a queued run whose attempt on a lost node is fenced waits."""
    node = fence["node"]
    return (f"waiting for its attempt on node {node}, lost while it ran, to be confirmed ended: by that attempt's "
            f"flow process or node {node}'s e31 worker (started again there); if that machine is off for good: "
            f"e31 node {node} --down --pool POOL")


def _return_reserve_s() -> float:
    """The seconds a run keeps before its deadline to return its output
    (:func:`e31.flows.compile.return_reserve_s`, as the flow process reads it;
    a bad ``E31_RETURN_RESERVE_S`` here counts as its 30 s floor): the
    planner plans a deadline job's work to end that long before its deadline."""
    from e31.errors import E31Error
    from e31.flows.compile import RETURN_RESERVE_FLOOR_S, return_reserve_s

    try:
        return return_reserve_s()
    except E31Error:
        return RETURN_RESERVE_FLOOR_S


def _output_s(returns: dict[str, float] | None, name: str, estimate: Any) -> float:
    """Seconds job ``name``'s output takes to return, unless its estimate is its past runs' time
    (which holds the return already)."""
    return 0.0 if estimate.source == "history" else float((returns or {}).get(name, 0.0))


def _secs(value: timedelta | None) -> float | None:
    return value.total_seconds() if value is not None else None

