"""The live queue's one door to the Prefect API: submit jobs, read the pool's
flow runs as planner input, and record the planner's decisions on them.

How a queue maps onto Prefect (nothing else holds queue state):

- a pool file's pool is a Prefect **work pool** of type ``e31`` named after
  it, served by ``e31 worker`` processes (one per node);
- a submitted job is a **flow run** of ``run_job`` (deployment
  ``e31-job/queue-<pool>``), created ``Scheduled`` with the state name
  ``Queued``; runs of any other deployment on the work pool (``e31 deploy
  --cron``) join the queue when their scheduled time comes;
- a waiting run's state message is the planner's reason, and its scheduled
  time the planned start (so the UI shows both, and the run never turns
  ``Late``);
- a placed run gets ``job_variables`` ``e31_node``, ``gpu_devices``, ``cpus``
  and the state ``Scheduled`` named ``Placed`` at the current time: only the
  ``e31 worker`` of that node takes it;
- ``Pending``/``Running``/``Cancelling`` runs, and ``Placed`` ones, hold their
  resources until their state is final (the output returned);
- a refused run ends ``Failed`` with the reason.

Everything here is a plain function of a Prefect client; the policy is in
:mod:`e31.flows.placement` (no Prefect import).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from e31.flows.placement import Node, Placement, QueuedJob, RunningJob
from e31.flows.placement.estimates import estimate_runtime
from e31.specs import JobSpec
from e31.specs.pool import PoolSpec

QUEUED, PLACED = "Queued", "Placed"
#: The node, GPU devices and CPUs of a placement, in a flow run's ``job_variables``.
NODE_VAR, DEVICES_VAR, CPUS_VAR, ATTEMPT_VAR = "e31_node", "gpu_devices", "cpus", "e31_attempt"
#: Seconds ahead of now a waiting run's scheduled time is kept at least (Prefect marks runs past
#: their scheduled time Late).
AHEAD_S = 120.0
#: Seconds without a worker heartbeat after which its node counts as lost.
LEASE_S = 60.0
#: Id prefix of the stand-in job that holds a node whose worker is not answering.
DOWN = "~down~"
#: Seconds a crash is left to settle (the worker and Prefect's crash handling report it) before a requeue.
SETTLE_S = 3.0


def work_pool_name(pool: PoolSpec) -> str:
    """The Prefect work pool of an E31 pool (its ``name``)."""
    return pool.name


def deployment_name(pool: PoolSpec) -> str:
    """The deployment name (under the ``e31-job`` flow) that ``e31 submit`` creates runs of."""
    return f"queue-{pool.name}"


def nodes_of(pool: PoolSpec) -> list[Node]:
    """The planner's nodes of a pool declaration (``count`` expanded)."""
    return [Node(name, n.gpus, n.cpus, n.memory, n.gpu_type) for n in pool.nodes for name in n.names()]


#: The Prefect worker type of E31 work pools (``e31 worker``, :mod:`e31.deployments.worker`).
WORKER_TYPE = "e31"


def ensure_pool(client: Any, pool: PoolSpec, job_template: dict[str, Any] | None = None) -> str:
    """Create the pool's work pool (type ``e31``, with ``job_template`` as
    its base job template: the E31 worker's) and its queue deployment when
    missing; returns the deployment's id."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    from e31.flows.deploy import ENTRYPOINT, FLOW_NAME

    name = work_pool_name(pool)
    try:
        client.read_work_pool(name)
    except ObjectNotFound:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type=WORKER_TYPE, base_job_template=job_template or {}))
        except ObjectAlreadyExists:
            pass
    try:
        return str(client.read_deployment_by_name(f"{FLOW_NAME}/{deployment_name(pool)}").id)
    except ObjectNotFound:
        pass
    from prefect.deployments.runner import RunnerDeployment

    from e31.flows.job import run_job

    deployment = RunnerDeployment.from_flow(run_job, name=deployment_name(pool), work_pool_name=name,
                                            description=f"E31 queue of pool {pool.name}: e31 submit creates runs")
    deployment.entrypoint = ENTRYPOINT
    return str(deployment.apply(work_pool_name=name))


_DEPLOYMENTS: dict[tuple[str, str], str] = {}  # (API URL, pool) -> its queue deployment's id, once ensured


def submit(client: Any, pool: PoolSpec, parameters: dict[str, Any], tags: list[str],
           job_template: dict[str, Any] | None = None) -> Any:
    """Create the queued flow run of a job (``parameters``: the flow's
    ``spec`` and ``code_dir``); returns the flow run."""
    from prefect.states import Scheduled

    key = (str(client.api_url), pool.name)
    if key not in _DEPLOYMENTS:
        _DEPLOYMENTS[key] = ensure_pool(client, pool, job_template)
    deployment_id = _DEPLOYMENTS[key]
    return client.create_flow_run_from_deployment(
        deployment_id, parameters=parameters, tags=tags, name=str(parameters["spec"].get("name")),
        state=Scheduled(name=QUEUED, message="Queued: waiting for the scheduler to place it",
                        scheduled_time=datetime.now(timezone.utc) + timedelta(seconds=AHEAD_S)))


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
    time, as its scratch folder and destination are the job's)."""

    now: float
    nodes: list[Node]
    runs: dict[str, Any] = field(default_factory=dict)
    specs: dict[str, JobSpec] = field(default_factory=dict)
    running: list[RunningJob] = field(default_factory=list)
    queued: list[QueuedJob] = field(default_factory=list)
    bad: dict[str, str] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    requeue: list[str] = field(default_factory=list)
    blocked: dict[str, str] = field(default_factory=dict)
    lease_s: float = LEASE_S


_SPECS: dict[str, JobSpec] = {}  # flow run id -> parsed spec (a run's parameters never change)


def _spec(run: Any) -> JobSpec:
    key = str(run.id)
    if key not in _SPECS:
        _SPECS[key] = JobSpec.model_validate((run.parameters or {}).get("spec"))
    return _SPECS[key]


def _ts(value: Any) -> float | None:
    return value.timestamp() if value is not None else None


def _deadline(spec: JobSpec, start: datetime) -> float | None:
    from e31.flows.compile import resolve_deadline

    deadline, _ = resolve_deadline(spec, start)
    return deadline.timestamp() if deadline else None


def live_nodes(client: Any, pool: PoolSpec, now: float, lease_s: float = LEASE_S) -> dict[str, float]:
    """Node name -> the last heartbeat (Unix seconds) of its ``e31 worker``,
    for workers heard from within ``lease_s`` seconds."""
    found = {}
    for worker in client.read_workers_for_work_pool(work_pool_name(pool)):
        beat = _ts(worker.last_heartbeat_time)
        if beat is not None and now - beat <= lease_s:
            found[worker.name] = max(beat, found.get(worker.name, 0.0))
    return found


def inputs_key(spec: Any) -> tuple[str, ...]:
    """A job's inputs as a key: the sorted ``data[].url`` of its spec (a
    JobSpec or its JSON form); () when it reads nothing."""
    data = spec.get("data") if isinstance(spec, dict) else [d.model_dump() for d in spec.data]
    return tuple(sorted(str(d.get("url")) for d in data or [] if isinstance(d, dict)))


def read(client: Any, pool: PoolSpec, now: float | None = None, history: dict[str, list[float]] | None = None,
         lease_s: float = LEASE_S, staged: dict[tuple[str, ...], list[str]] | None = None) -> Snapshot:
    """Read every non-final flow run of the pool's work pool (and crashed ones
    that may be retried) as planner input.  ``history``: job name -> past run
    times in seconds (for jobs without a ``duration``); ``staged``: inputs
    key -> nodes holding those inputs staged (data locality)."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType

    now = time.time() if now is None else now
    snap = Snapshot(now=now, nodes=nodes_of(pool), lease_s=lease_s)
    alive = live_nodes(client, pool, now, lease_s)
    types = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.CANCELLING, StateType.CRASHED]
    runs, page = [], 200  # the API answers at most a page at a time
    while True:
        got = client.read_flow_runs(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[work_pool_name(pool)])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=types))),
            limit=page, offset=len(runs))
        runs += got
        if len(got) < page:
            break
    known = {n.name for n in snap.nodes}
    for run in runs:
        key = str(run.id)
        snap.runs[key] = run
        try:
            spec = _spec(run)
        except Exception as exc:  # not an E31 job spec: cannot be planned
            snap.bad[key] = f"its spec parameter is not a valid job spec ({type(exc).__name__})"
            continue
        snap.specs[key] = spec
        state, variables = run.state, run.job_variables or {}
        node = variables.get(NODE_VAR)
        req = spec.request
        if state.type == StateType.CRASHED:
            settled = now - (_ts(state.timestamp) or now) >= SETTLE_S  # the worker may still be reporting the crash
            if settled and (run.run_count or 0) <= req.retries:  # run_count: the attempts that started
                snap.requeue.append(key)
            continue
        holding = state.type in (StateType.PENDING, StateType.RUNNING, StateType.CANCELLING) or \
            (state.type == StateType.SCHEDULED and state.name == PLACED)
        if holding:
            if node not in known:
                continue
            if node not in alive:
                snap.lost.append(key)
                continue
            start = _ts(run.start_time) or _ts(state.timestamp) or now
            estimate = estimate_runtime(_secs(req.duration), _secs(req.limit or req.duration),
                                        (history or {}).get(spec.name, ()))
            snap.running.append(RunningJob(
                id=key, node=node, devices=tuple(int(d) for d in variables.get(DEVICES_VAR) or ()),
                cpus=int(variables.get(CPUS_VAR) or req.cpus), memory=req.memory or 0,
                start=start, expected_end=start + estimate.runtime_s))
            continue
        due = state.name == QUEUED or (_ts(run.expected_start_time) or now) <= now
        if state.type == StateType.SCHEDULED and due:
            submitted = _ts(run.created) if state.name == QUEUED else _ts(run.expected_start_time)
            submitted = min(submitted or now, now)
            estimate = estimate_runtime(_secs(req.duration), _secs(req.limit or req.duration),
                                        (history or {}).get(spec.name, ()))
            snap.queued.append(QueuedJob(
                id=key, name=spec.name, gpus=req.gpus, cpus=req.cpus, memory=req.memory or 0,
                gpu_type=getattr(req, "gpu_type", None), submitted=submitted,
                deadline=_deadline(spec, datetime.fromtimestamp(submitted, timezone.utc)),
                runtime_s=estimate.runtime_s, limit_s=_secs(req.limit or req.duration) or estimate.runtime_s,
                runtime_source=estimate.source, runtime_note=estimate.note,
                preferred_nodes=tuple(n for n in (staged or {}).get(inputs_key(spec), ()) if n in known)))
    _one_run_per_job(snap)
    for node in snap.nodes:  # a node without a live worker takes nothing: held whole until its worker answers
        if node.name not in alive:
            snap.running.append(RunningJob(id=f"{DOWN}{node.name}", node=node.name, devices=tuple(range(node.gpus)),
                                           cpus=node.cpus, memory=node.memory, start=now, expected_end=now + lease_s))
    return snap


def _one_run_per_job(snap: Snapshot) -> None:
    """Hold back a queued run while another run of the same job runs or is
    queued ahead of it (two runs of a job would share its destination)."""
    active = {snap.specs[r.id].name: r.id for r in snap.running}
    keep = []
    for job in sorted(snap.queued, key=lambda j: (j.submitted, j.id)):
        other = active.get(job.name)
        if other is None:
            active[job.name] = job.id
            keep.append(job)
            continue
        state = "running" if any(r.id == other for r in snap.running) else "queued ahead"
        snap.blocked[job.id] = (f"waiting for the run {job.name} ({other[:8]}) of this job, {state}, to end: one run "
                                "of a job at a time")
    snap.queued = keep


def humane(reason: str, snap: Snapshot) -> str:
    """``reason`` with each flow run id it names given as ``NAME (ID8)``, and
    a node held for want of a worker said so."""
    for key, spec in snap.specs.items():
        if key in reason:
            reason = reason.replace(key, f"{spec.name} ({key[:8]})")
    if DOWN in reason:
        reason = re.sub(rf"after job {re.escape(DOWN)}(\S+) ends", r"once node \1's e31 worker answers", reason)
        reason = reason.replace(DOWN, "no worker on ")
    return reason


def _secs(value: timedelta | None) -> float | None:
    return value.total_seconds() if value is not None else None


_CLOCK = re.compile(r"\d\d:\d\d:\d\d UTC")


def _same(old: str | None, new: str) -> bool:
    """Whether a waiting run's reason is the same but for its clock times
    (the planned start moves a little at every tick; the scheduled time
    says it, rewritten when it moves by a minute or more)."""
    return old is not None and _CLOCK.sub("", old) == _CLOCK.sub("", new)


def _log(client: Any, run_id: str, message: str) -> None:
    """One line in the flow run's log (its page in the UI opens on it): the
    queue's word on the run, as it changes.  Best effort."""
    from prefect.client.schemas.actions import LogCreate

    try:
        client.create_logs([LogCreate(name="e31.scheduler", level=20, message=message,
                                      timestamp=datetime.now(timezone.utc), flow_run_id=run_id)])
    except Exception:
        pass


def refuse_at_destination(spec: JobSpec, run_id: str, reason: str) -> None:
    """Write a ``failed`` manifest (no files) saying why the queue refused
    the job at its destination's ``partial/``, as a refused ``e31 run`` would
    not start at all: best effort (the destination's credentials may live
    only on the workers)."""
    try:
        from e31.flows.compile import compile_plan
        from e31.tasks.deliver import ReturnTarget, write_failure_manifest
        from e31.tasks.storage.options import register_destination

        plan = compile_plan(spec)
        register_destination(spec, plan)
        write_failure_manifest(ReturnTarget(job=spec.name, run_id=run_id, output_dir=str(plan.output_dir),
                                            output_url=plan.output_url, declared=plan.output_files, gpus=plan.gpus,
                                            cpus=plan.cpus, spec_sha256=plan.spec_sha256,
                                            checkpoint_url=plan.checkpoint_url), f"refused by the queue: {reason}")
    except Exception:
        pass


def apply(client: Any, snap: Snapshot, placements: list[Placement]) -> dict[str, int]:
    """Record the plan on the flow runs: place the runs that start now (their
    node, devices and CPUs in ``job_variables``, state ``Placed``), write each
    waiting run's reason and planned start (only when they changed), fail the
    refused ones with their reason; crash the runs of lost nodes and requeue
    crashed runs with retries left.  Returns counts per action."""
    from prefect.states import Crashed, Failed, Scheduled

    counts = {"start": 0, "wait": 0, "refuse": 0, "lost": 0, "requeued": 0, "unchanged": 0}
    now = datetime.fromtimestamp(snap.now, timezone.utc)
    for key in snap.lost:
        run = snap.runs[key]
        node = (run.job_variables or {}).get(NODE_VAR)
        client.set_flow_run_state(key, Crashed(message=f"node {node} stopped answering (no worker heartbeat for "
                                                       f"{snap.lease_s:g} s); its resources are free again"),
                                  force=True)
        counts["lost"] += 1  # requeued by a later tick, once the crash has settled, when it has retries left
    for key in snap.requeue:
        run = snap.runs[key]
        attempt = run.run_count or 1
        client.set_flow_run_state(key, Scheduled(  # first: a crashed run's job variables cannot be changed
            name=QUEUED, scheduled_time=now + timedelta(seconds=AHEAD_S),
            message=f"Queued: retry {attempt} of {snap.specs[key].request.retries} after a crash (resumes from its "
                    "newest durable checkpoint)"), force=True)
        client.update_flow_run(key, job_variables={ATTEMPT_VAR: attempt})
        counts["requeued"] += 1
    for key, why in snap.bad.items():
        run = snap.runs[key]
        if run.state.type.value == "SCHEDULED" and run.state.name == QUEUED:
            client.set_flow_run_state(key, Failed(message=f"refused: {why}"), force=True)
            counts["refuse"] += 1
    for key, why in snap.blocked.items():
        run, message = snap.runs[key], f"Queued: {why}"
        if run.state.name == QUEUED and run.state.message == message:
            counts["unchanged"] += 1
            continue
        client.set_flow_run_state(key, Scheduled(name=QUEUED, message=message,
                                                 scheduled_time=now + timedelta(seconds=AHEAD_S)), force=True)
        _log(client, key, message)
        counts["wait"] += 1
    for p in placements:
        run = snap.runs[p.job]
        if p.action == "start":
            attempt = int((run.job_variables or {}).get(ATTEMPT_VAR, 0))
            client.update_flow_run(p.job, job_variables={NODE_VAR: p.node, DEVICES_VAR: list(p.devices),
                                                         CPUS_VAR: p.cpus, ATTEMPT_VAR: attempt})
            job = next((q for q in snap.queued if q.id == p.job), None)
            local = "; inputs already staged there" if job is not None and p.node in job.preferred_nodes else ""
            client.set_flow_run_state(p.job, Scheduled(name=PLACED, scheduled_time=now,
                                                       message=humane(p.reason, snap) + local), force=True)
            _log(client, p.job, f"Placed: {humane(p.reason, snap)}{local}")
            counts["start"] += 1
        elif p.action == "refuse":
            client.set_flow_run_state(p.job, Failed(message=f"refused: {humane(p.reason, snap)}"), force=True)
            refuse_at_destination(snap.specs[p.job], p.job, humane(p.reason, snap))
            counts["refuse"] += 1
        else:
            message = f"Queued: {humane(p.reason, snap)}"
            planned = datetime.fromtimestamp(max(p.start or snap.now, snap.now + AHEAD_S), timezone.utc)
            current = run.state
            same_time = run.next_scheduled_start_time is not None and \
                abs(run.next_scheduled_start_time.timestamp() - planned.timestamp()) < AHEAD_S / 2
            if current.name == QUEUED and _same(current.message, message) and same_time:
                counts["unchanged"] += 1
                continue
            client.set_flow_run_state(p.job, Scheduled(name=QUEUED, scheduled_time=planned, message=message),
                                      force=True)
            if not _same(current.message, message):
                _log(client, p.job, message)
            counts["wait"] += 1
    return counts
