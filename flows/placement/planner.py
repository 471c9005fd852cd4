"""The planner: where and when each queued job runs on a pool. Pure and deterministic.

``plan(nodes, running, queued, now, policy)`` answers, for every queued job:
start now on node N with GPU devices [i, j]; or wait, with a planned start,
node and the reason; or a refusal with the reason (:mod:`.refusals`).  The
same input gives the same plan: every order breaks ties by submission time,
then job id, and nodes by pool order.

How a plan is made
------------------
Jobs are taken in the policy's priority order.  The first ``depth`` jobs that
cannot start now each get a *reservation*: the earliest start, on any node,
at which the job fits for its whole planned time (staging + runtime estimate)
around everything reserved before it (:mod:`.capacity`).  A later job starts
now only where it fits without touching any reservation, so it delays none of
the jobs ahead of it: this is *backfilling*.  Jobs beyond ``depth`` that
cannot start now get an estimated start (after every reservation on the
soonest-free node) but hold nothing.  With ``depth=1`` in arrival order this is
EASY backfilling (Lifka 1995; Mu'alem & Feitelson 2001), the rule of Slurm's
backfill scheduler; with a large depth it is conservative backfilling.

Policies
--------
``fcfs``: arrival order, no overtaking (a job starts only once every earlier
one has).  ``easy``: arrival order, EASY backfilling.  ``edf``: deadline jobs
first, earliest deadline first, then arrival order, EASY backfilling.

``e31`` (the default):

1. Deadline jobs that need the time go first, earliest deadline first (EDF):
   a first pass plans everyone by priority (2.-3.); each deadline job that
   would end after its deadline is promoted ahead of all others, and the plan
   is made again (at most three passes).  A deadline job with slack is not
   promoted, so it does not push other jobs back.
2. Then jobs that have waited ``age_limit_s`` or longer, in arrival order:
   the ageing bound.  Once a job has waited that long, only promoted deadline
   jobs and longer-waiting jobs come before it, so no job waits much beyond
   ``age_limit_s`` plus the time the pool needs to free room for it.
3. Then every other job by its current expansion factor ``(wait + estimate) /
   max(estimate, 10 s)``, highest first: short jobs go first, but every
   waiting job's priority grows while it waits (the estimate is staging plus
   the planning runtime).  This orders for low bounded slowdown
   ``max((wait + run) / max(run, 10 s), 1)`` (Feitelson et al. 1997).
4. The first ``depth`` waiting jobs (64 by default) get reservations, so the
   jobs at the head cannot be pushed back by backfilling; deeper jobs only
   backfill.  Every job is re-planned at every event, so a job's reservation
   can move when a job of higher priority arrives or a running job ends early.

Guarantees (given the runtime estimates): no node is ever oversubscribed in
GPUs, CPUs or memory; nothing starts before ``now``; a deadline job whose
deadline cannot be met even if it started now is refused, never run to miss
it; a feasible deadline job alone among jobs without deadlines on a free pool
is planned to finish by its deadline; no job is overtaken by backfilling once
it holds a reservation.

Speed: the search is exact for the reserved jobs; the rest cost a start-now
check (with failures remembered) and an append.  A plan of 10,000 queued jobs
on 125 nodes x 8 GPUs takes well under a second
(``tests/benchmarks/bench_planner.py``).
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence

from .capacity import Capacity, devices_of, lowest_bits
from .model import Node, PlanInputError, Placement, QueuedJob, RunningJob
from .reasons import Explainer, start_reason
from .refusals import deadline_refusal, eligible_nodes, fit_refusal

__all__ = ["AGE_LIMIT_S", "DEPTH", "POLICIES", "plan"]

POLICIES = ("e31", "fcfs", "easy", "edf")
#: Waiting jobs that get reservations under ``e31`` and ``fcfs`` (``easy``/``edf``: 1).
DEPTH = 64
#: After this many seconds of waiting a job goes ahead of every job not yet promoted (``e31``).
AGE_LIMIT_S = 12 * 3600.0
_PASSES = 3

_Slot = tuple[float, int, int, bool]  # start, node index, device mask, reserved


class _Job:
    """A queued job with what the passes need, computed once."""

    __slots__ = ("job", "req", "eligible", "kind", "preferred")

    def __init__(self, job: QueuedJob, eligible: list[bool], where: dict[str, int]) -> None:
        self.job = job
        self.req = (job.gpus, job.cpus, job.memory, job.occupancy_s)
        self.eligible = None if all(eligible) else eligible
        self.kind = job.gpu_type.lower() if job.gpu_type else None
        self.preferred = tuple(where[n] for n in job.preferred_nodes if n in where and eligible[where[n]])


def _order(policy: str, jobs: list[_Job], now: float, promoted: dict[str, tuple], AGE=0) -> list[_Job]:
    arrival = lambda j: (j.job.submitted, j.job.id)  # noqa: E731
    if policy in ("fcfs", "easy"):
        return sorted(jobs, key=arrival)
    if policy == "edf":
        return sorted(jobs, key=lambda j: (j.job.deadline is None, j.job.deadline or 0.0, *arrival(j)))
    first = sorted((j for j in jobs if j.job.id in promoted), key=lambda j: (*promoted[j.job.id][:2], *arrival(j)))

    def expansion(j: _Job) -> tuple:
        est = j.req[3]
        import os
        w = float(os.environ.get("E31_W", "0"))
        P = float(os.environ.get("E31_P", "0"))
        wait = now - j.job.submitted
        xf = (wait + est) / max(est, 10.0) * (1 + w * j.job.gpus / 8)
        if P and wait >= AGE:
            xf = max(xf, P * wait / AGE)
        return (-xf, *arrival(j))

    return first + sorted((j for j in jobs if j.job.id not in promoted), key=expansion)


def _place(cap: Capacity, order: list[_Job], depth: int, fcfs: bool, late: dict | None = None) -> dict[str, _Slot]:
    """One pass: reservations for the first ``depth`` waiting jobs, backfilling for the rest."""
    now = cap.now
    slots: dict[str, _Slot] = {}
    reservations, floor, deep = 0, now, []
    F = float(os.environ.get("E31_F", "0"))
    for j in order:
        job, req = j.job, j.req
        hit = None
        if late and job.id in late and F:
            ls = late[job.id]
            if ls > now:
                hit = cap.earliest(req, j.eligible, now + F * (ls - now), ls + 1e-9, preferred=j.preferred)
        if hit is not None:
            start, i, mask = hit
        elif reservations < depth:
            start, i, mask = cap.earliest(req, j.eligible, floor if fcfs else now, preferred=j.preferred)
        elif not (fcfs and floor > now) and (hit := cap.start_now(req, j.eligible, j.kind, j.preferred)):
            start, (i, mask) = now, hit
        else:
            deep.append(j)
            floor = max(floor, now + 1e-6) if fcfs else floor
            continue
        devices = lowest_bits(mask, job.gpus)
        cap.reserve(i, start, start + req[3], devices, job.cpus, job.memory, job.id)
        if late and job.id in late and start > now and os.environ.get("E31_DRAIN") and late[job.id] <= now:
            cap.drain[i] = max(cap.drain[i], start)
        slots[job.id] = (start, i, devices, True)
        if start > now:
            reservations += 1
        if fcfs:
            floor = start
    tails = sorted((cap.tail(i), i) for i in range(len(cap.nodes)))
    for j in deep:  # estimates only: after every reservation on the soonest-free eligible node
        pos = next(p for p, (_, i) in enumerate(tails) if j.eligible is None or j.eligible[i])
        tail, i = tails.pop(pos)
        start = max(tail, now, floor if fcfs else now)
        floor = start if fcfs else floor
        insort(tails, (start + j.req[3], i))
        slots[j.job.id] = (start, i, lowest_bits((1 << cap.nodes[i].gpus) - 1, j.job.gpus), False)
    return slots


import os
def _at_risk(jobs: list[_Job], slots: dict[str, _Slot], now: float, age_limit_s: float) -> dict[str, tuple]:
    """Jobs the plan fails: a deadline job ending after its deadline (key ``(0, deadline)``); a job
    that has waited ``age_limit_s`` already (key ``(1, submitted + age_limit_s)``)."""
    risky = {}
    for j in jobs:
        job = j.job
        start = slots[job.id][0]
        M = float(os.environ.get("E31_M", "0.1"))
        if job.deadline is not None and start + j.req[3] > job.deadline and job.deadline - j.req[3] - now < float(os.environ.get("E31_H", "1e18")):
            risky[job.id] = (0, job.deadline, min(job.deadline - j.req[3] - max(M * job.runtime_s, 300.0),
                                                  job.submitted + age_limit_s * float(os.environ.get("E31_AF", "1"))))
        elif start > now and now - job.submitted >= age_limit_s:
            risky[job.id] = (1, job.submitted + age_limit_s, now)
        elif start > now and (now - job.submitted >= age_limit_s - float(os.environ.get("E31_WIN", "0")) and start > job.submitted + age_limit_s):
            risky[job.id] = (1, job.submitted + age_limit_s, job.submitted + age_limit_s)
    return risky


def plan(nodes: Sequence[Node], running: Sequence[RunningJob], queued: Sequence[QueuedJob], now: float,
         policy: str = "e31", *, depth: int | None = None, age_limit_s: float = AGE_LIMIT_S,
         explain: bool = True) -> list[Placement]:
    """Plan ``queued`` onto ``nodes`` at ``now`` (Unix seconds), around the ``running`` jobs.

    ``policy``: ``e31``, ``fcfs``, ``easy`` or ``edf`` (module docstring).  ``depth``: how many
    waiting jobs get reservations (default :data:`DEPTH`; ``easy`` and ``edf`` always 1).
    ``age_limit_s``: the ageing bound of ``e31`` in seconds.  ``explain=False`` leaves the reasons of
    started and waiting jobs empty (a simulation needs only the decisions; they are the same).

    Returns one :class:`Placement` per queued job: the planned ones in priority order, then the
    refused ones in the order given.

    Raises:
        PlanInputError: an unknown policy, a depth below 1, two jobs with one id, or running jobs
            that do not fit the pool (:class:`.capacity.Capacity`).
    """
    if policy not in POLICIES:
        raise PlanInputError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)}")
    depth = 1 if policy in ("easy", "edf") else DEPTH if depth is None else depth
    if depth < 1:
        raise PlanInputError(f"depth must be at least 1 (got {depth})")
    ids = [j.id for j in running] + [j.id for j in queued]
    if len(set(ids)) != len(ids):
        raise PlanInputError("two running or queued jobs have the same id")
    now = float(now)
    where = {node.name: i for i, node in enumerate(nodes)}
    cap = Capacity(nodes, running, now)
    jobs, refused, shapes = [], [], {}
    for job in queued:
        key = (job.gpu_type and job.gpu_type.lower(), job.gpus, job.cpus, job.memory)
        if key not in shapes:
            shapes[key] = eligible_nodes(nodes, job)
        why = fit_refusal(nodes, job, shapes[key]) or deadline_refusal(job, now)
        if why:
            refused.append(Placement(job.id, "refuse", None, (), job.cpus, None, None, why, reserved=False))
        else:
            jobs.append(_Job(job, shapes[key], where))
    import os
    P = float(os.environ.get("E31_P", "0"))
    promoted = {} if P else {j.job.id: (1, j.job.submitted + age_limit_s, now) for j in jobs if now - j.job.submitted >= age_limit_s}
    for attempt in range(_PASSES if policy == "e31" else 1):
        if attempt:
            cap = Capacity(nodes, running, now)
        order = _order(policy, jobs, now, promoted, age_limit_s)
        slots = _place(cap, order, depth, fcfs=policy == "fcfs", late={k: v[2] for k, v in promoted.items()})
        risky = _at_risk(jobs, slots, now, age_limit_s) if policy == "e31" else {}
        risky = {k: v for k, v in risky.items() if k not in promoted or v < promoted[k]}
        if not risky or attempt == _PASSES - 1:
            break
        promoted.update(risky)
    explainer = Explainer(cap, depth, policy == "fcfs") if explain else None
    return [_placement(j, slots[j.job.id], cap, explainer) for j in order] + refused


def _placement(j: _Job, slot: _Slot, cap: Capacity, explainer: Explainer | None) -> Placement:
    job, (start, i, devices, reserved) = j.job, slot
    node, end = cap.nodes[i].name, start + j.req[3]
    if start <= cap.now:
        why = start_reason(job, node, devices, end, cap.now) if explainer else ""
        return Placement(job.id, "start", node, devices_of(devices), job.cpus, start, end, why)
    why = explainer.wait(job, j.eligible, i, start, reserved) if explainer else ""
    return Placement(job.id, "wait", node, devices_of(devices), job.cpus, start, end, why, reserved)
