"""Which running jobs give way when a job with priority over them must start now (pure, no IO).

A job may be preempted when it declared so (``request.preemptible``), has run at least the pool's
``min_run`` in its current run (Slurm's ``PreemptExemptTime`` has the same purpose: nothing
thrashes), and has been preempted fewer than ``max_per_day`` times in the last 24 hours.  A
preemption stops the victim like any other stop: it commits its newest checkpoint, returns its
output marked partial and waits again; what it loses is the work since its newest durable
checkpoint.

:func:`choose_victims` picks, for one job that must start now and fits nowhere as things stand,
the node and the set of victims to stop there:

1. the least work lost (resource-seconds since each victim's newest durable checkpoint, summed);
2. then the lowest priority (the most important victim of the set is as unimportant as can be);
3. then the fewest victims;
4. then the node that comes first in the pool, then victim ids (a stable answer from tick to tick).

Only minimal sets are chosen (no victim could be left running and the job still fit).  Batch
schedulers order victims much the same way: PBS Professional's documentation has the scheduler take
jobs of the lowest preemption level, the most recently started first, and Kueue sorts candidates by
lower priority, then the most recently admitted.  Both use the start time as a stand-in for the work
a victim loses; E31's checkpoints make that loss known, so it comes first here.  Nothing is preempted for a job that fits on some node
without it: the caller asks only for a job that must start now (a reservation's start has come, a
deadline would be missed) and this function checks the "without it" half.

:func:`plan_preemptions` asks it for two kinds of job, in this order: a deadline job the plan would
otherwise start too late (:func:`deadline_at_risk`), then a waiting job with priority by attained
service over running jobs that declared no duration (:func:`.attained.ranks_above`: the victims have
received far more service, a level at least two deeper, than it).  In the second case only the running jobs the
waiting job outranks, that have run ``attained_min_run_s`` in their current run and that committed a
checkpoint at most ``attained_loss_s`` seconds ago, are candidates (the ``over`` argument of :func:`choose_victims`): a job gives way for attained service
just after a checkpoint, so each such preemption loses a few minutes of work, not half a checkpoint
interval on average.

Cost: at most :data:`MAX_CANDIDATES` candidates per node are considered (those losing the least),
so one node costs at most ``2**MAX_CANDIDATES`` fit checks, and a node whose free capacity plus all
its candidates' cannot hold the job is skipped after one sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import combinations

from .attained import by_attained
from .attained import rank as rank_level
from .attained import ranks_above
from .model import Node, Placement, QueuedJob, RunningJob
from .tenants import Tenancy, borrowing, fair_order, within_bound

__all__ = ["ATTAINED_LOSS_S", "ATTAINED_MIN_RUN_S", "DAY_S", "MAX_CANDIDATES", "Need", "PlannedPreemption", "Preemption", "PreemptionRules",
           "choose_victims", "deadline_at_risk", "deferred_preemptions", "lost_seconds", "lost_work", "may_preempt", "plan_preemptions",
           "RESTART_S", "within_overhead"]

#: The window of ``max_per_day``, seconds.
DAY_S = 86_400.0
#: Most running jobs of one node considered as victims (those whose preemption loses the least).
MAX_CANDIDATES = 10


#: Seconds of work a running job may lose at most when it is preempted for attained service (the
#: seconds since its newest durable checkpoint): it gives way just after a checkpoint, not half-way
#: to the next one.  A deadline at risk is not held to it.
ATTAINED_LOSS_S = 300.0
#: Seconds a preempted job's restart is taken to cost when the pool does not say (its staging and the
#: work's start again, up to its first step): the overhead budget (:func:`within_overhead`) counts it.
RESTART_S = 60.0
#: Seconds a running job must have run in its current run before it is preempted for attained service (the
#: pool's ``preemption.attained_min_run``): a wide job preempted again and again for short ones pays a
#: restart each time, and on the Lublin-Feitelson model a 10-minute bound lost 2.2% of the GPU-hours to
#: them, a 1-hour bound 0.94% (docs/performance.md).  Deadlines and quotas need only ``min_run_s``.
ATTAINED_MIN_RUN_S = 3600.0


@dataclass(frozen=True)
class PreemptionRules:
    """The pool's ``preemption:`` options in seconds: ``min_run_s`` (default 600) and ``max_per_day``
    (None: no cap); ``attained_min_run_s`` (default :data:`ATTAINED_MIN_RUN_S`), the run a job must have had
    before it is preempted for attained service; ``attained_loss_s`` (default :data:`ATTAINED_LOSS_S`; None: no bound), the
    most seconds of work a job preempted for attained service loses (:func:`plan_preemptions`);
    ``max_overhead`` (a share, e.g. 0.01; None: no bound), the most of a job's service its preemptions
    for attained service may cost it (:func:`within_overhead`), each counted as ``restart_s`` seconds of
    restart (default :data:`RESTART_S`) plus the work it throws away."""

    min_run_s: float = 600.0
    max_per_day: int | None = None
    attained_loss_s: float | None = ATTAINED_LOSS_S
    max_overhead: float | None = None
    restart_s: float = RESTART_S
    attained_min_run_s: float = ATTAINED_MIN_RUN_S


@dataclass(frozen=True)
class Need:
    """What the job that must start asks for: ``gpus``, ``cpus``, ``memory`` (BYTES, 0: not stated) and
    ``gpu_type`` (case-insensitive, None: any node)."""

    gpus: int
    cpus: int
    memory: int
    gpu_type: str | None = None


@dataclass(frozen=True)
class Preemption:
    """The answer: stop ``victims`` (running job ids, least loss first) on ``node``; the job then gets
    ``devices`` (the lowest-numbered devices free once they are gone).  ``lost`` is the work the victims
    redo, resource-seconds (:func:`lost_work`, summed)."""

    node: str
    victims: tuple[str, ...]
    devices: tuple[int, ...]
    lost: float


def lost_seconds(job: RunningJob, now: float) -> float:
    """Seconds of work a preemption of ``job`` at ``now`` (Unix seconds) throws away: since its newest
    durable checkpoint, or since its start when it has none."""
    since = max(job.start, job.checkpoint_at) if job.checkpoint_at is not None else job.start
    return max(now - since, 0.0)


def lost_work(job: RunningJob, now: float) -> float:
    """Resource-seconds a preemption of ``job`` at ``now`` (Unix seconds) throws away: the seconds since
    its newest durable checkpoint (since its start when it has none) times the GPUs it holds, or its CPUs
    when it holds no GPU."""
    return lost_seconds(job, now) * (len(job.devices) or job.cpus)


def within_overhead(job: RunningJob, now: float, rules: PreemptionRules) -> bool:
    """Whether preempting ``job`` for attained service at ``now`` keeps what its preemptions cost it within
    ``rules.max_overhead`` of the seconds it has been served (its earlier runs' and this one's; always
    True without a bound).  Each earlier preemption is counted at what one for attained service costs at
    most, ``restart_s + attained_loss_s`` (or ``restart_s`` plus the work this one loses when there is no
    loss bound; one for a deadline may have cost more), this one
    at ``restart_s +`` :func:`lost_seconds`: a job served 10 hours may lose at most 6 minutes under a
    bound of 1%, so the restarts of a wide job preempted for many short ones stay a bounded share
    of the pool's GPU-hours, whatever the workload.  A bound of 0 forbids every such preemption."""
    if rules.max_overhead is None:
        return True
    served = job.attained_s / max(len(job.devices) or job.cpus, 1) + max(now - job.start, 0.0)
    loss = lost_seconds(job, now)
    each = rules.restart_s + (rules.attained_loss_s if rules.attained_loss_s is not None else loss)
    return len(job.preemptions) * each + rules.restart_s + loss <= rules.max_overhead * served


def may_preempt(job: RunningJob, now: float, rules: PreemptionRules) -> bool:
    """Whether ``job`` may be a victim at ``now``: preemptible, on one node (a multi-node job is never a
    victim: stopping it frees room on several nodes, which the choice of victims, node by node, does not
    weigh), run at least ``rules.min_run_s`` seconds, and preempted fewer than ``rules.max_per_day`` times in
    the last :data:`DAY_S` seconds."""
    if not job.preemptible or job.gang or now - job.start < rules.min_run_s:
        return False
    if rules.max_per_day is None:
        return True
    return sum(1 for t in job.preemptions if now - DAY_S < t <= now) < rules.max_per_day


def _fits(node: Node, need: Need, held: Sequence[RunningJob]) -> tuple[int, ...] | None:
    """The devices ``need`` gets on ``node`` beside the jobs ``held`` (lowest numbers), or None when it
    does not fit."""
    busy = {d for job in held for d in job.devices}
    free = [d for d in range(node.gpus) if d not in busy]
    if len(free) < need.gpus or node.cpus - sum(j.cpus for j in held) < need.cpus:
        return None
    if node.memory - sum(j.memory for j in held) < need.memory:
        return None
    return tuple(free[:need.gpus])


def _eligible(node: Node, need: Need) -> bool:
    if need.gpu_type is not None and (node.gpu_type or "").lower() != need.gpu_type.lower():
        return False
    return node.gpus >= need.gpus and node.cpus >= need.cpus and node.memory >= need.memory


def choose_victims(need: Need, nodes: Sequence[Node], running: Sequence[RunningJob], now: float,
                   rules: PreemptionRules, over: Callable[[RunningJob], bool] | None = None) -> Preemption | None:
    """The preemption that lets a job asking for ``need`` start at ``now`` (Unix seconds), chosen by the
    order in the module docstring, or None: the job fits on some node without one, or no allowed set of
    victims (:func:`may_preempt`, and ``over(victim)`` when given: the job has priority over it) makes
    room on any node of the job's GPU type."""
    by_node: dict[str, list[RunningJob]] = {}
    for job in running:  # a multi-node job holds room on each of its nodes
        for name, devices in job.parts:
            by_node.setdefault(name, []).append(replace(job, node=name, devices=devices) if job.gang else job)
    usable = [(i, node) for i, node in enumerate(nodes) if _eligible(node, need)]
    if any(_fits(node, need, by_node.get(node.name, [])) is not None for _, node in usable):
        return None  # it can start as early without a preemption
    best: tuple | None = None
    answer: Preemption | None = None
    for index, node in usable:
        here = by_node.get(node.name, [])
        candidates = sorted((j for j in here if may_preempt(j, now, rules) and (over is None or over(j))),
                            key=lambda j: (lost_work(j, now), j.priority, j.id))[:MAX_CANDIDATES]
        if _fits(node, need, [j for j in here if j not in candidates]) is None:
            continue  # even stopping every candidate leaves too little
        fitting: list[frozenset[str]] = []
        for size in range(1, len(candidates) + 1):
            for chosen in combinations(candidates, size):
                ids = frozenset(j.id for j in chosen)
                if any(smaller <= ids for smaller in fitting):
                    continue  # not minimal: a subset of it already makes room
                devices = _fits(node, need, [j for j in here if j.id not in ids])
                if devices is None:
                    continue
                fitting.append(ids)
                lost = sum(lost_work(j, now) for j in chosen)
                key = (lost, max(j.priority for j in chosen), size, index, sorted(ids))
                if best is None or key < best:
                    best = key
                    order = sorted(chosen, key=lambda j: (lost_work(j, now), j.priority, j.id))
                    answer = Preemption(node.name, tuple(j.id for j in order), devices, lost)
    return answer


@dataclass(frozen=True)
class PlannedPreemption:
    """One preemption a plan calls for: ``job`` (the queued job that gets the room) and ``preemption``
    (where, whom, which devices)."""

    job: str
    preemption: Preemption


def deadline_at_risk(job: QueuedJob, placement: Placement, now: float) -> bool:
    """True when ``placement`` (the plan's answer for ``job``) starts it too late for its deadline: its
    planned start plus its work time (:attr:`.model.QueuedJob.work_s`) passes its work deadline."""
    by = job.work_deadline
    start = placement.start if placement.start is not None else now
    return placement.action == "wait" and by is not None and start + job.work_s > by


def plan_preemptions(nodes: Sequence[Node], running: Sequence[RunningJob], queued: Sequence[QueuedJob],
                     placements: Sequence[Placement], now: float,
                     rules: PreemptionRules, tenancy: Tenancy | None = None) -> list[PlannedPreemption]:
    """The preemptions the plan calls for, in the plan's priority order (``placements`` as
    :func:`.planner.plan` returns them): first for its deadline jobs at risk
    (:func:`deadline_at_risk`); then, with ``tenancy``, for each waiting job within its tenant's quota
    over running jobs of other tenants that hold what they borrowed beyond their quotas
    (:func:`.tenants.borrowing`: Kueue's reclaim within a cohort); then for each waiting job over running jobs that have received more
    service than it (a level of attained service at least two deeper, :func:`.attained.ranks_above`), have run
    ``rules.attained_min_run_s`` in their current run, and would lose at most ``rules.attained_loss_s`` seconds of work (:func:`lost_seconds`): a waiting job that
    outranks only jobs far from their last checkpoint waits for one to commit its next (a job with no
    checkpoint is, once past that many seconds of its run, never preempted for attained service).  The jobs
    the plan starts now hold their room (never victims: they have not run their minimum), and a
    running job is the victim of at most one preemption; a job gets one only when it fits nowhere now
    without it (:func:`choose_victims`)."""
    by_id = {job.id: job for job in queued}
    held = list(running)
    fresh: set[str] = set()  # jobs this plan starts: never victims, whatever the pool's min_run (0 included)
    for p in placements:
        if p.action == "start" and p.node is not None:
            job = by_id[p.job]
            held.append(RunningJob(job.id, p.node, p.devices, job.cpus, job.memory, now, now + job.occupancy_s,
                                   tenant=job.tenant, gang=p.gang))
            fresh.add(job.id)
    planned: list[PlannedPreemption] = []
    done: set[str] = set()
    failed: set[tuple] = set()  # (need, level) that found no victims this time: the same answer for the next

    def take(job: QueuedJob, over: Callable[[RunningJob], bool] | None, key: tuple | None) -> None:
        nonlocal held
        if key is not None and key in failed or job.nodes > 1:  # a gang gets no victims: it waits for room
            return
        if not within_bound(job, held, tenancy):  # its tenant's borrow limit holds it back, as in the plan
            return
        def allowed(victim: RunningJob) -> bool:
            return victim.id not in fresh and (over is None or over(victim))

        chosen = choose_victims(Need(job.gpus, job.cpus, job.memory, job.gpu_type), nodes, held, now, rules, allowed)
        if chosen is None:
            if key is not None:
                failed.add(key)
            return
        planned.append(PlannedPreemption(job.id, chosen))
        done.add(job.id)
        fresh.add(job.id)
        gone = set(chosen.victims)
        held = [j for j in held if j.id not in gone]
        held.append(RunningJob(job.id, chosen.node, chosen.devices, job.cpus, job.memory, now, now + job.occupancy_s,
                               preemptible=job.preemptible, attained_s=job.attained_s, no_duration=by_attained(job),
                               tenant=job.tenant))

    for p in placements:
        job = by_id.get(p.job)
        if job is not None and deadline_at_risk(job, p, now):
            take(job, None, None)
    if tenancy is not None and tenancy.matters():  # reclaim: a job within its quota takes back what others borrow
        lent = borrowing(held, tenancy)
        ordered = [by_id[p.job] for p in placements if p.job in by_id and p.action != "refuse"]
        _, nominal = fair_order(ordered, running, tenancy)
        for p in placements:
            job = by_id.get(p.job)
            if job is None or p.action != "wait" or job.id in done or job.id not in nominal:
                continue
            take(job, lambda r, job=job: r.id in lent and r.tenant != job.tenant, None)
    def cheap(victim: RunningJob) -> bool:  # a preemption for attained service: a long enough run, little lost
        return now - victim.start >= rules.attained_min_run_s and \
            (rules.attained_loss_s is None or lost_seconds(victim, now) <= rules.attained_loss_s) and \
            within_overhead(victim, now, rules)

    for p in placements:
        job = by_id.get(p.job)
        if job is None or p.action != "wait" or job.id in done:
            continue
        if not any(may_preempt(r, now, rules) and ranks_above(job, r, now) and cheap(r) and r.id not in fresh
                   for r in held):
            continue
        take(job, lambda r, job=job: ranks_above(job, r, now) and cheap(r),
             (job.gpus, job.cpus, job.memory, job.gpu_type, rank_level(job, now)))
    return planned


def deferred_preemptions(nodes: Sequence[Node], running: Sequence[RunningJob], queued: Sequence[QueuedJob],
                         placements: Sequence[Placement], planned: Sequence[PlannedPreemption], now: float,
                         rules: PreemptionRules,
                         tenancy: Tenancy | None = None) -> dict[str, tuple[float, Preemption] | str]:
    """For each deadline job at risk (:func:`deadline_at_risk`), and with ``tenancy`` each waiting job
    within its tenant's quota, that :func:`plan_preemptions` found no victims for now: the preemption it gets once running jobs reach the pool's minimum run (a
    :class:`Preemption` whose ``lost`` is replaced by the Unix time it becomes allowed, at most one day
    ahead), or why it gets none (a phrase: the jobs on its way are not preemptible, or have reached the
    pool's ``max_per_day``).  What a queued job's reason tells (Slurm's ``PreemptExemptTime`` plays the
    same part and is as silent)."""
    taken = {v for p in planned for v in p.preemption.victims} | {p.job for p in planned}
    by_id = {job.id: job for job in queued}
    held = [r for r in running if r.id not in taken]
    out: dict[str, tuple[float, Preemption] | str] = {}
    if tenancy is not None and tenancy.matters():  # a job within its quota waits to take back what others borrow
        lent = borrowing(running, tenancy)
        ordered = [by_id[p.job] for p in placements if p.job in by_id and p.action != "refuse"]
        _, nominal = fair_order(ordered, running, tenancy)
        for p in placements:
            job = by_id.get(p.job)
            if job is None or job.id in taken or p.action != "wait" or job.id not in nominal or job.nodes > 1:
                continue
            mine = [r for r in held if r.id in lent and r.tenant != job.tenant and r.preemptible]
            need = Need(job.gpus, job.cpus, job.memory, job.gpu_type)
            for at in sorted({max(r.start + rules.min_run_s, now) for r in mine if r.start + rules.min_run_s > now}):
                if p.start is not None and at >= p.start or at > now + DAY_S:
                    break  # it starts as early without one
                chosen = choose_victims(need, nodes, held, at, rules, lambda v, job=job: v.id in lent and v.tenant != job.tenant)
                if chosen is not None:
                    out[job.id] = (at, chosen)
                    break
    for p in placements:
        job = by_id.get(p.job)
        if job is None or job.id in taken or job.id in out or job.nodes > 1 or not deadline_at_risk(job, p, now):
            continue
        need = Need(job.gpus, job.cpus, job.memory, job.gpu_type)
        by = job.work_deadline
        times = sorted({r.start + rules.min_run_s for r in held if r.preemptible and r.start + rules.min_run_s > now})
        found = None
        for at in times:
            if at > now + DAY_S or (by is not None and at + job.work_s > by):
                break
            chosen = choose_victims(need, nodes, held, at, rules, lambda victim: True)
            if chosen is not None:
                found = (at, chosen)
                break
        if found is not None:
            out[job.id] = found
        elif rules.max_per_day is not None and not any(may_preempt(r, max(now, r.start + rules.min_run_s), rules)
                                                        for r in held if r.preemptible):
            out[job.id] = (f"no preemption: the jobs on its way have been preempted the pool's max_per_day "
                           f"({rules.max_per_day}) times in 24 hours")
    return out
