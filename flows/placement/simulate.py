"""Replay jobs through the planner in simulated time.

Event-driven: at each submission or completion the queue is planned again
with :func:`.planner.plan` (the same code the live queue uses) and the jobs it
says to start now are started.  A job holds its node for its staging time plus
its ACTUAL run time, capped at its limit; the planner only ever sees what the
job declared (its estimate).  A running job past its estimate is shown to the
planner as ending a tenth of its estimate later (at least a minute), never
after its hard stop (:func:`overrun`); assuming the hard stop at once would
move every reservation behind it off that node for hours it is rarely
needed.  Jobs the planner refuses (no node holds them, or their deadline
became infeasible) do not run.

Metrics (seconds; waits from submission to start):

* ``avg_bounded_slowdown``: mean of ``max((wait + run) / max(run, 10 s), 1)``
  over the jobs that ran, ``run`` being the time on the node (Feitelson,
  Rudolph, Schwiegelshohn, Sevcik & Wong 1997, with their 10 s threshold);
* ``utilization``: busy GPU-seconds over GPU-seconds available from the first
  submission to the last end when any job asks for GPUs, else the same in
  CPU-seconds (the resource the jobs use: :func:`resource_of`);
* ``deadlines_met``: jobs with a deadline that ran and ended by it, out of
  ``deadlines_total`` (all jobs with a deadline, refused ones included) and
  ``deadlines_feasible`` (those that could have met it on an empty pool: some
  node holds the job, and it ends by its deadline when started at once);
* ``mean_completion_s``: mean of end minus submission over the jobs that ran;
* ``preemptions`` and ``lost_gpu_hours``: how many runs were preempted, and the
  resource-hours (GPU-hours, CPU-hours for a CPU trace) they held and lost.

Preemption (``preemption`` given): at each event, after the plan, the deadline
jobs it starts too late get victims (:func:`.preemption.plan_preemptions`)
among the preemptible running jobs.  A victim keeps the work up to its newest
checkpoint (one each ``checkpoint_every_s`` seconds of work; none without it),
goes back to the queue with its submission time (its priority) kept and its estimate less the work
its checkpoints kept, and pays
``restart_cost_s`` seconds at each later start; the job it gave way to starts
at once on the freed devices (the stop's grace is not modelled).  Waits count
from submission to the first start.  While jobs wait, the replay also plans
just after each checkpoint of a preemptible running job ordered by attained
service (the moment it may be preempted for one: :mod:`.preemption`), as the
live queue's ticks, every few seconds, would.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from .attained import by_attained
from .attained import width as service_width
from .model import Gang, Node, PlanInputError, QueuedJob, RunningJob, id_order
from .planner import AGE_LIMIT_S, plan
from .preemption import PreemptionRules, plan_preemptions
from .refusals import eligible_nodes
from .tenants import Tenancy, decayed_service

__all__ = ["BSLD_THRESHOLD_S", "MIN_CHECKPOINT_EVERY_S", "OVERRUN_SHARE", "WAKE_AFTER_S", "Result", "SimJob", "overrun",
           "resource_of", "simulate"]

#: The bounded-slowdown threshold: runs shorter than this count as this long (seconds).
BSLD_THRESHOLD_S = 10.0
#: A job past its estimate is expected to end within this share of the estimate (re-asked each event).
OVERRUN_SHARE = 0.1
#: Seconds after a checkpoint at which a replay plans again (the checkpoint counts as committed by then).
WAKE_AFTER_S = 1.0
#: The shortest checkpoint interval a replay takes, seconds: each checkpoint of a job that may be preempted
#: for attained service is a planning event while jobs wait, so the replay's cost grows as 1 / interval
#: (a 2,000-job replay: 1 s at 1,800 s, 10 s at 60 s).
MIN_CHECKPOINT_EVERY_S = 1.0


@dataclass(frozen=True)
class SimJob:
    """A job to replay: what it declares (``job``; ``job.submitted`` is its submission time), how
    long it really runs (``actual_s``, seconds, capped at ``job.limit_s`` per run) and whether it may
    be preempted (``preemptible``)."""

    job: QueuedJob
    actual_s: float
    preemptible: bool = False


@dataclass(frozen=True)
class Result:
    """What a replay measured (see the module docstring); ``planning_s`` is the wall time spent in
    :func:`plan` (seconds), ``starts``/``ends`` each job's simulated start and end."""

    jobs: int
    refused: int
    makespan_s: float
    avg_wait_s: float
    max_wait_s: float
    avg_bounded_slowdown: float
    utilization: float
    deadlines_met: int
    deadlines_total: int
    deadlines_feasible: int
    mean_completion_s: float
    preemptions: int
    lost_gpu_hours: float
    planning_s: float
    starts: dict[str, float]
    ends: dict[str, float]
    tenants: dict[str, dict[str, float]] | None = None

    def summary(self) -> dict[str, float | int]:
        """The metrics as one JSON-ready dict (no per-job times; ``tenants`` only in a replay with tenants)."""
        out = asdict(self)
        del out["starts"], out["ends"]
        if out["tenants"] is None:
            del out["tenants"]
        return out


def overrun(job: RunningJob, now: float, hard_stop: float) -> RunningJob:
    """A running job past its expected end, as the planner is shown it: ending
    :data:`OVERRUN_SHARE` of its estimate (at least 60 s) from ``now``, never after its
    ``hard_stop`` (Unix seconds); asked again at the next event."""
    end = min(hard_stop, now + max(60.0, OVERRUN_SHARE * (job.expected_end - job.start)))
    return replace(job, expected_end=end)


def simulate(nodes: Sequence[Node], jobs: Sequence[SimJob], policy: str = "e31", *, depth: int | None = None,
             age_limit_s: float = AGE_LIMIT_S, preemption: PreemptionRules | None = None,
             checkpoint_every_s: float | None = None, restart_cost_s: float = 0.0,
             tenancy: Tenancy | None = None) -> Result:
    """Replay ``jobs`` on ``nodes`` under ``policy`` (see :func:`.planner.plan`); returns the metrics.
    ``preemption``: the pool's rules (None: nothing is preempted); ``checkpoint_every_s`` and
    ``restart_cost_s`` (seconds): what a preempted job keeps and pays (module docstring).
    ``tenancy``: the pool's tenants (each job's ``tenant``): quotas, borrowing, fair share and reclaim
    as the live queue applies them, each tenant's usage decayed as it accrues in simulated time; the
    result then counts, per tenant (``Result.tenants``): ``jobs`` run, ``mean_wait_s`` and ``gpu_hours``
    (resource-hours held: CPU-hours for a CPU trace).

    Raises:
        PlanInputError: (from the planner) an unknown policy, a bad depth, duplicate job ids; a
            ``checkpoint_every_s`` under :data:`MIN_CHECKPOINT_EVERY_S`, or a
            ``preemption.attained_loss_s`` under :data:`WAKE_AFTER_S` (the replay would never see a
            checkpoint recent enough to preempt for attained service).
        RuntimeError: the replay stopped making progress (a planner bug).
    """
    if checkpoint_every_s is not None and not checkpoint_every_s >= MIN_CHECKPOINT_EVERY_S:
        raise PlanInputError(f"checkpoint_every_s must be at least {MIN_CHECKPOINT_EVERY_S:g} s, got "
                             f"{checkpoint_every_s!r}")
    if preemption is not None and preemption.attained_loss_s is not None and \
            not preemption.attained_loss_s >= WAKE_AFTER_S:
        raise PlanInputError(f"preemption.attained_loss_s must be at least {WAKE_AFTER_S:g} s (the replay plans "
                             f"{WAKE_AFTER_S:g} s after a checkpoint), got {preemption.attained_loss_s!r}")
    pending = sorted((replace(s, job=replace(s.job, preemptible=s.preemptible and preemption is not None))
                      for s in jobs), key=lambda s: (s.job.submitted, id_order(s.job.id)))
    left = {s.job.id: max(s.actual_s, 0.0) for s in pending}  # work still to do (seconds)
    may = {s.job.id for s in pending if s.preemptible and s.job.nodes == 1}  # a gang is never preempted
    by_id = {s.job.id: s.job for s in pending}
    queue: dict[str, QueuedJob] = {}
    running: dict[str, tuple[RunningJob, float, float, int]] = {}  # id -> (as planned, hard stop, work start, gen)
    ends: list[tuple[float, str, int]] = []
    # (time, id, gen): just after a checkpoint of a running job ordered by attained service, when it may be
    # preempted for a job that outranks it (the live queue's ticks come every few seconds; a replay plans
    # only at events, so a checkpoint is one)
    wakes: list[tuple[float, str, int]] = []
    starts, finished, held, refused = {}, {}, {}, 0
    preempted_at: dict[str, tuple[float, ...]] = {}
    progress: dict[str, float] = {}  # work kept by checkpoints across preemptions (seconds)
    attained: dict[str, float] = {}  # resource-seconds received in earlier runs (attained service)
    lost = 0.0
    planning, nxt, gen = 0.0, 0, 0
    resource = resource_of([s.job for s in pending])

    def start(job: QueuedJob, node: str, devices: tuple[int, ...], now: float, gang: Gang = ()) -> None:
        nonlocal gen
        gen += 1
        cost = restart_cost_s if job.id in preempted_at else 0.0
        work_start = now + job.staging_s + cost
        end = work_start + min(left[job.id], job.limit_s)
        expected = now + job.staging_s + cost + job.runtime_s
        planned = RunningJob(job.id, node, devices, job.cpus, job.memory, now, expected, preemptible=job.id in may,
                             preemptions=preempted_at.get(job.id, ()), attained_s=attained.get(job.id, 0.0),
                             no_duration=by_attained(job), tenant=job.tenant, gang=gang)
        running[job.id] = (planned, now + job.staging_s + cost + job.limit_s, work_start, gen)
        heapq.heappush(ends, (end if end > now else now, job.id, gen))
        if preemption is not None and checkpoint_every_s and job.id in may and by_attained(job):
            heapq.heappush(wakes, (work_start + checkpoint_every_s + WAKE_AFTER_S, job.id, gen))
        starts.setdefault(job.id, now)
        finished[job.id] = end

    usage: dict[str, tuple[tuple[float, float, float], float]] = {}  # tenant -> (decayed usage, as of when)

    def used(planned: RunningJob, end: float) -> None:  # a run ended: its service joins its tenant's usage
        if tenancy is None:
            return
        half = tenancy.half_life_s
        before, at = usage.get(planned.tenant, ((0.0, 0.0, 0.0), end))
        decay = 2 ** (-(end - at) / half) if end > at else 1.0
        n = 1 + len(planned.gang)
        added = decayed_service((float(planned.gpus_held), float(planned.cpus * n), float(planned.memory * n)),
                                planned.start, end, end, half)
        usage[planned.tenant] = (tuple(b * decay + a for b, a in zip(before, added)), max(end, at))

    def tenancy_at(now: float) -> Tenancy | None:  # every tenant's usage as of now, running jobs' so far included
        if tenancy is None:
            return None
        half = tenancy.half_life_s
        totals: dict[str, list[float]] = {}
        for name, (value, at) in usage.items():
            totals[name] = [v * 2 ** (-(now - at) / half) for v in value]
        for r, _, _, _ in running.values():
            n = 1 + len(r.gang)
            add = decayed_service((float(r.gpus_held), float(r.cpus * n), float(r.memory * n)), r.start, now, now,
                                  half)
            totals[r.tenant] = [a + b for a, b in zip(totals.get(r.tenant, [0.0, 0.0, 0.0]), add)]
        return replace(tenancy, tenants={name: replace(tenancy.of(name), usage=tuple(totals.get(name, (0.0,) * 3)))
                                         for name in {*tenancy.tenants, *totals}})

    def stop(job_id: str, now: float) -> None:
        nonlocal lost
        planned, _, work_start, _ = running.pop(job_id)
        used(planned, now)
        kept = _kept(now - work_start, checkpoint_every_s)
        left[job_id] -= kept
        width = len(planned.devices) if resource == "gpus" else planned.cpus
        lost += width * (now - planned.start - kept)
        attained[job_id] = attained.get(job_id, 0.0) + service_width(len(planned.devices), planned.cpus) * (
            now - planned.start)
        held[job_id] = held.get(job_id, 0.0) + now - planned.start
        preempted_at[job_id] = (*preempted_at.get(job_id, ()), now)
        progress[job_id] = progress.get(job_id, 0.0) + kept
        declared = by_id[job_id]  # waits again for what is left of its estimate (its checkpoint is its progress)
        queue[job_id] = replace(declared, runtime_s=max(declared.runtime_s - progress[job_id], 60.0),
                                attained_s=attained[job_id], waiting_since=now)
        finished.pop(job_id, None)

    profiles: dict = {}  # the nodes' capacity profiles, kept between plans (the same plans, built faster)
    while nxt < len(pending) or ends or queue:
        times = [t for t in ((pending[nxt].job.submitted if nxt < len(pending) else None),
                             (ends[0][0] if ends else None)) if t is not None]
        if not times:
            raise RuntimeError(f"the replay stalled with {len(queue)} queued job(s) and nothing running")
        if wakes and wakes[0][0] < min(times):
            at, job_id, which = heapq.heappop(wakes)
            if job_id not in running or running[job_id][3] != which:
                continue  # it ended or was preempted since
            heapq.heappush(wakes, (at + checkpoint_every_s, job_id, which))
            if not queue:
                continue  # nobody waits: no plan can change
            now = at
        else:
            now = min(times)
        while ends and ends[0][0] <= now:
            _, done, which = heapq.heappop(ends)
            if done in running and running[done][3] == which:
                planned = running.pop(done)[0]
                held[done] = held.get(done, 0.0) + finished[done] - planned.start
                used(planned, finished[done])
        while nxt < len(pending) and pending[nxt].job.submitted <= now:
            queue[pending[nxt].job.id] = pending[nxt].job
            nxt += 1
        shown = [_shown(r, now, stop_at, work_start, checkpoint_every_s)
                 for r, stop_at, work_start, _ in running.values()]
        began = time.perf_counter()
        tenants_now = tenancy_at(now)
        placements = plan(nodes, shown, list(queue.values()), now, policy, depth=depth, age_limit_s=age_limit_s,
                          explain=False, tenancy=tenants_now, profiles=profiles)
        chosen = plan_preemptions(nodes, shown, list(queue.values()), placements, now, preemption,
                                  tenants_now) if preemption else []
        planning += time.perf_counter() - began
        for p in placements:
            if p.action == "refuse":
                refused += 1
                del queue[p.job]
            elif p.action == "start":
                start(queue.pop(p.job), p.node, p.devices, now, p.gang)
        for c in chosen:
            for victim in c.preemption.victims:
                stop(victim, now)
            start(queue.pop(c.job), c.preemption.node, c.preemption.devices, now)
    result = _measure(nodes, by_id, starts, finished, held, refused, planning, len(
        [t for times in preempted_at.values() for t in times]), lost / 3600.0)
    return result if tenancy is None else replace(result, tenants=_per_tenant(by_id, starts, finished, held, resource))


def _per_tenant(jobs: dict[str, QueuedJob], starts: dict[str, float], ends: dict[str, float],
                held: dict[str, float], resource: str) -> dict[str, dict[str, float]]:
    """Per tenant: ``jobs`` that ran to their end, ``mean_wait_s`` (submission to first start) and
    ``gpu_hours`` (resource-hours held, every run of its jobs)."""
    out: dict[str, dict[str, float]] = {}
    for job_id, job in jobs.items():
        row = out.setdefault(job.tenant, {"jobs": 0, "mean_wait_s": 0.0, "gpu_hours": 0.0})
        width = (job.gpus if resource == "gpus" else job.cpus) * job.nodes
        row["gpu_hours"] += width * held.get(job_id, 0.0) / 3600.0
        if job_id in ends and job_id in starts:
            row["jobs"] += 1
            row["mean_wait_s"] += starts[job_id] - job.submitted
    for row in out.values():
        row["mean_wait_s"] = row["mean_wait_s"] / row["jobs"] if row["jobs"] else 0.0
    return dict(sorted(out.items()))


def _kept(worked_s: float, every_s: float | None) -> float:
    """Seconds of work a run stopped after ``worked_s`` keeps: up to its newest checkpoint."""
    if not every_s or worked_s < every_s:
        return 0.0
    return (worked_s // every_s) * every_s


def _shown(job: RunningJob, now: float, hard_stop: float, work_start: float, every_s: float | None) -> RunningJob:
    """A running job as the planner is shown it: its newest checkpoint's time, and :func:`overrun`
    once past its expected end."""
    kept = _kept(now - work_start, every_s)
    if kept:
        job = replace(job, checkpoint_at=work_start + kept)
    return job if job.expected_end > now else overrun(job, now, hard_stop)


def _width(job: QueuedJob, gpus: bool) -> int:
    """What ``job`` holds while it runs: GPUs (``gpus``) or CPUs, on all its nodes."""
    return (job.gpus if gpus else job.cpus) * job.nodes


def resource_of(jobs: Sequence[QueuedJob]) -> str:
    """The resource a replay's utilisation is measured in: ``gpus`` when any job asks for a GPU,
    else ``cpus`` (CPU jobs on a pool with GPUs are measured in CPUs)."""
    return "gpus" if any(j.gpus for j in jobs) else "cpus"


def _measure(nodes: Sequence[Node], jobs: dict[str, QueuedJob], starts: dict[str, float],
             ends: dict[str, float], held: dict[str, float], refused: int, planning: float, preemptions: int,
             lost_hours: float) -> Result:
    gpus = resource_of(list(jobs.values())) == "gpus"
    capacity = sum(n.gpus for n in nodes) if gpus else sum(n.cpus for n in nodes)
    first = min((j.submitted for j in jobs.values()), default=0.0)
    last = max(ends.values(), default=first)
    span = last - first
    waits, slowdowns, completions, busy = [], [], [], 0.0
    ran = 0
    for job_id, start in starts.items():
        if job_id not in ends:  # preempted, then refused (its deadline could no longer be met): it never ended
            busy += _width(jobs[job_id], gpus) * held.get(job_id, 0.0)
            continue
        ran += 1
        job, run = jobs[job_id], held.get(job_id, ends[job_id] - start)
        wait = start - job.submitted
        waits.append(wait)
        completions.append(ends[job_id] - job.submitted)
        slowdowns.append(max((ends[job_id] - job.submitted) / max(run, BSLD_THRESHOLD_S), 1.0))
        busy += _width(job, gpus) * run
    with_deadline = [j for j in jobs.values() if j.deadline is not None]
    return Result(
        jobs=ran, refused=refused, makespan_s=span,
        avg_wait_s=sum(waits) / len(waits) if waits else 0.0, max_wait_s=max(waits, default=0.0),
        avg_bounded_slowdown=sum(slowdowns) / len(slowdowns) if slowdowns else 0.0,
        utilization=busy / (capacity * span) if capacity and span > 0 else 0.0,
        deadlines_met=sum(1 for j in with_deadline if j.id in ends and ends[j.id] <= j.deadline),
        deadlines_total=len(with_deadline),
        deadlines_feasible=sum(1 for j in with_deadline
                               if j.submitted + j.work_s <= j.work_deadline and sum(eligible_nodes(nodes, j)) >= j.nodes),
        mean_completion_s=sum(completions) / len(completions) if completions else 0.0,
        preemptions=preemptions, lost_gpu_hours=lost_hours,
        planning_s=planning, starts=starts, ends=ends,
    )
