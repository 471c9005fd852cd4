"""The planner: where and when each queued job runs on a pool. Pure and deterministic.

``plan(nodes, running, queued, now, policy)`` answers, for every queued job:
start now on node N with GPU devices [i, j]; or wait, with a planned start,
node and the reason; or a refusal with the reason (:mod:`.refusals`).  The
same input gives the same plan: every order breaks ties by submission time,
then job id, and nodes by pool order (a job asking for no GPU tries the nodes
with the fewest GPUs first, so CPU work leaves GPU nodes to GPU work).

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

1. Deadline jobs that need the time go first, earliest deadline first (EDF).
   A first pass plans everyone by 2.-3.; each deadline job that would end
   after its deadline is promoted ahead of all others and the plan is made
   again (at most three passes; :mod:`.policy`).  A promoted job is placed
   no earlier than needed: in the second half of the time left before its
   latest start (deadline - estimate - a margin of 10% of the estimate, at
   least 5 minutes; and no later than the ageing bound), or as early as
   possible when nothing fits there.  A deadline job with slack is not
   promoted, so it does not push others back.
2. Then jobs that have waited ``age_limit_s`` (6 hours) or longer, in arrival
   order: the ageing bound.  Once a job has waited that long only deadline
   jobs that need the time and jobs that waited longer come before it, and it
   holds a reservation at the earliest place the pool has room for it.
3. Then every other job by its current expansion factor ``1 + wait /
   max(estimate, 10 s)`` (:func:`.policy.expansion_factor`), highest first:
   at equal waits the shorter job goes first, and every waiting job's
   priority grows while it waits (the estimate is the job's whole time on
   the node, :attr:`.model.QueuedJob.occupancy_s`; equal factors go shortest
   first).  This orders for low bounded slowdown ``max((wait + run) /
   max(run, 10 s), 1)`` (Feitelson, Rudolph, Schwiegelshohn, Sevcik & Wong
   1997).
4. The first ``depth`` waiting jobs (64 by default) hold reservations
   (conservative backfilling); deeper jobs only backfill.  A job ranked
   after a reservation starts now only where it could run to its limit
   (:attr:`.model.QueuedJob.hard_occupancy_s`) without touching the
   reservations ahead of it, and holds the node that long in the plan, so
   a backfilled job that overruns its estimate cannot delay them (EASY's
   guarantee rests on the limit, as Slurm's backfill does); its later
   reservations are on its estimate (:func:`_behind`).  Every
   job is re-planned at every event, so a reservation moves earlier when a
   running job ends early, and a job of higher priority that arrives can
   take it.
5. Work conservation: after a deadline job was placed no earlier than
   needed, every waiting job that fits now around everything else starts
   now (:func:`_fill_now`), so room is never left idle that a waiting job
   could use without delaying a reservation ahead of it (a hypothesis
   property in ``tests/flows/placement/test_promises.py``).

Guarantees (given the runtime estimates): no node is ever oversubscribed in
GPUs, CPUs or memory; nothing starts before ``now``; a deadline job whose
deadline cannot be met even if it started now is refused, never run to miss
it; a feasible deadline job among jobs without deadlines on a free pool is
planned to finish by its deadline; a job that holds a reservation is never
delayed by a job backfilled behind it, even one that runs to its limit; no
room is idle now that a waiting job could use harmlessly; a job without a
deadline waits at most
the age limit plus the time the pool needs to free room for it and for the
jobs aged before it.

On the benchmark (``tests/benchmarks/bench_planner.py``: a week of 10,000 jobs on 125 nodes x 8
GPUs) this halves FCFS+EASY's average bounded slowdown, meets as many deadlines as EDF, and keeps
the longest wait within 1.5x FCFS+EASY's.

Speed, and why a depth: the search for a reservation is exact (every hole
of every node), the rest cost a start-now check (with failures remembered)
and an append.  On 125 nodes x 8 GPUs with 10,000 queued jobs a plan takes
about 0.35 s with the default depth of 64, 0.5 s with 1,000, and 8 s with a
reservation for every job under ``e31`` (fcfs: 0.6 s, its starts only move
later): reservations deep in a long queue would be recomputed at the next
event anyway, so only the head of the queue holds them.  A simulation re-plans
a queue of tens to hundreds of jobs in milliseconds.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import replace
from itertools import islice
from collections.abc import Sequence

from .attained import by_attained
from .capacity import Capacity, devices_of, lowest_bits
from .gangs import place_gang
from .model import Node, PlanInputError, Placement, QueuedJob, RunningJob
from .policy import Promotion, Ranked, at_risk, order, overdue
from .reasons import Explainer, gang_start_reason, start_reason
from .text import clock
from .refusals import deadline_refusal, eligible_nodes, fit_refusal
from .tenants import BorrowLimits, Tenancy, amount_words, beyond_quota, bounded, exceeds_limit, fair_order

__all__ = ["AGE_LIMIT_S", "DEPTH", "POLICIES", "plan"]

POLICIES = ("e31", "fcfs", "easy", "edf")
#: Waiting jobs that get reservations under ``e31`` and ``fcfs`` (``easy``/``edf``: 1).
DEPTH = 64
#: The ageing bound of ``e31`` (seconds): a job that has waited this long goes ahead of all but
#: deadline jobs that need the time.
AGE_LIMIT_S = 6 * 3600.0
#: A deadline job promoted with time to spare is placed no earlier than this fraction of the way
#: from now to its latest start, leaving the time before it to others.
SLACK_USE = 0.5
_PASSES = 3
#: How long a job ordered by attained service holds its room in the plan (seconds): it starts in any room
#: free now, and a job with priority over it that needs the room later preempts it (:mod:`.attained`).
_MOMENT_S = 1.0

# start, node index, device mask, reserved, and a gang's other nodes: (node index, device mask) each
_Slot = tuple[float, int, int, bool, tuple[tuple[int, int], ...]]


def _place(cap: Capacity, ranked: list[Ranked], depth: int, fcfs: bool,
           promoted: dict[str, Promotion], limits: BorrowLimits | None = None) -> dict[str, _Slot]:
    """One pass: reservations for the first ``depth`` waiting jobs, backfilling for the rest.

    A job ranked after a reservation starts now only on its limit (:func:`_behind`).  With
    ``limits``, a job that would take its tenant past its borrow limit starts no earlier than
    :meth:`.tenants.BorrowLimits.after` says, a reservation there."""
    now = cap.now
    slots: dict[str, _Slot] = {}
    held: dict[str, float] = {}  # job id -> seconds its slot holds the node (estimate or limit)
    reservations, floor, blocked, deep, late = 0, now, False, [], False
    for j in ranked:
        job = j.job
        length = j.req[3]
        hit = None
        promotion = promoted.get(job.id)
        if job.nodes > 1:
            placed = place_gang(cap, j, promotion, reservations, depth, floor if fcfs else now, fcfs and blocked, SLACK_USE)
            if placed is not None and limits is not None and placed[0] <= now:
                if limits.allows(job):
                    limits.take(job, now + placed[2])
                else:  # its tenant's borrow limit: no earlier than enough of its tenant's running jobs end
                    placed = place_gang(cap, j, None, 0, 1, max(limits.after(job), floor if fcfs else now), False,
                                        SLACK_USE)
                    limits.hold(job, placed[0] + placed[2] if placed is not None else None)
            if placed is None:
                deep.append(j)
                blocked = True
                continue
            start, parts, length = placed
            taken = tuple((i, lowest_bits(mask, job.gpus)) for i, mask in parts)
            for i, devices in taken:
                cap.reserve(i, start, start + length, devices, job.cpus, job.memory, job.id)
            slots[job.id], held[job.id] = (start, *taken[0], True, taken[1:]), length
            if start > now:
                reservations += 1
                blocked = True
            if fcfs:
                floor = start
            continue
        if by_attained(job) and promotion is None:  # any room free now, reserved or not; else no reservation
            hit = cap.earliest((*j.req[:3], _MOMENT_S), j.eligible, now, now, preferred=j.preferred)
            if hit is None:
                deep.append(j)
                continue
            length = _MOMENT_S
        elif promotion is not None and promotion.start_by > now:  # no earlier than needed
            by = promotion.start_by
            hit = cap.earliest(j.req, j.eligible, now + SLACK_USE * (by - now), by, preferred=j.preferred)
            late = late or hit is not None
        if hit is not None:
            start, i, mask = hit
        elif reservations < depth and reservations:
            start, i, mask, length = _behind(cap, j, floor if fcfs else now)
        elif reservations < depth:
            start, i, mask = cap.earliest(j.req, j.eligible, floor if fcfs else now, preferred=j.preferred,
                                          wait_s=job.locality_wait_s)
        elif not (fcfs and blocked) and (hit := cap.start_now(j.hard, j.eligible, j.kind, j.preferred)):
            (start, (i, mask)), length = (now, hit), j.hard[3]
        else:
            deep.append(j)
            blocked = True  # first come, first served: nothing after it starts before it
            continue
        if limits is not None and start <= now:
            if limits.allows(job):
                limits.take(job, now + j.req[3])
            else:  # its tenant's borrow limit: no earlier than enough of its tenant's running jobs end
                start, i, mask = cap.earliest(j.req, j.eligible, max(limits.after(job), floor if fcfs else now),
                                              preferred=j.preferred)
                length = j.req[3]
                limits.hold(job, start + length)
        devices = lowest_bits(mask, job.gpus)
        cap.reserve(i, start, start + length, devices, job.cpus, job.memory, job.id)
        slots[job.id], held[job.id] = (start, i, devices, True, ()), length
        if start > now:
            reservations += 1
            blocked = True
        if fcfs:
            floor = start
    if late and not fcfs:
        deep = _fill_now(cap, ranked, slots, held, deep, limits)
    tails = sorted((cap.tail(i), i) for i in range(len(cap.nodes)))
    for j in deep:  # estimates only: after every reservation on the soonest-free eligible node(s)
        # the first eligible ones only (a scan of every node per job was most of a 100,000-job plan)
        picked = list(islice((p for p, (_, i) in enumerate(tails) if j.eligible is None or j.eligible[i]), j.job.nodes))
        got = [tails[p] for p in picked]
        for p in reversed(picked):
            del tails[p]
        start = max(max(tail for tail, _ in got), now, floor if fcfs else now)
        floor = start if fcfs else floor
        taken = []
        for _, i in got:
            insort(tails, (start + j.req[3], i))
            taken.append((i, lowest_bits((1 << cap.nodes[i].gpus) - 1, j.job.gpus)))
        slots[j.job.id] = (start, *taken[0], False, tuple(taken[1:]))
    return slots


def _behind(cap: Capacity, j: Ranked, after: float) -> tuple[float, int, int, float]:
    """Where a job ranked after a reservation goes: ``(start, node index, device mask, seconds held)``.

    It starts now only where it could run to its limit (:attr:`Ranked.hard`) without touching any
    reservation ahead of it, and then holds the node that long: a job that overruns its estimate
    cannot delay them (EASY's guarantee rests on the limit, as Slurm's backfill does).  A later
    start is a reservation on its estimate, as any other (it is planned again at every event); where
    its estimate fits now but its limit does not, that start is the earliest at which its limit
    fits."""
    now = cap.now
    if after <= now and (hit := cap.start_now(j.hard, j.eligible, j.kind, j.preferred)):
        return now, hit[0], hit[1], j.hard[3]
    start, i, mask = cap.earliest(j.req, j.eligible, after, preferred=j.preferred, wait_s=j.job.locality_wait_s)
    if start > now:
        return start, i, mask, j.req[3]
    start, i, mask = cap.earliest(j.hard, j.eligible, now + 1e-3, preferred=j.preferred)
    return start, i, mask, j.req[3]


def _fill_now(cap: Capacity, ranked: list[Ranked], slots: dict[str, _Slot], held: dict[str, float],
              deep: list[Ranked], limits: BorrowLimits | None = None) -> list[Ranked]:
    """Keep the plan work-conserving after a promoted deadline job was placed no earlier than
    needed: a waiting job that fits now, around every other placement (reservations ahead of it
    on its limit, as in :func:`_place`), starts now.  Without this a node the deferred job leaves
    idle stays idle when no other job fits the time before it, and the deferred start slides
    later at every re-plan.  Repeated until nothing moves (each job moves at most once).
    Returns the deep jobs still waiting."""
    now, waiting = cap.now, {j.job.id for j in deep}
    moved = True
    while moved:
        moved = False
        ahead = False  # a job ranked higher still waits for a reservation
        for j in ranked:
            job = j.job
            slot = slots.get(job.id)
            if slot is not None and slot[0] <= now:
                continue
            if slot is None and job.id not in waiting:
                continue
            if job.nodes > 1:  # a gang keeps its place: it is reserved on all its nodes, or only estimated
                ahead = ahead or slot is not None
                continue
            if limits is not None and not limits.allows(job):  # its tenant's borrow limit: it stays where it is
                ahead = ahead or slot is not None
                limits.hold(job)
                continue
            size = j.hard if ahead else j.req
            if slot is not None:
                start, i, devices, _, _ = slot
                cap.release(i, start, start + held[job.id], devices, job.cpus, job.memory, job.id)
            hit = cap.start_now(size, j.eligible, j.kind, j.preferred)  # failures remembered until a release
            if hit is not None:
                i, mask = hit
                devices = lowest_bits(mask, job.gpus)
                cap.reserve(i, now, now + size[3], devices, job.cpus, job.memory, job.id)
                slots[job.id], held[job.id] = (now, i, devices, True, ()), size[3]
                waiting.discard(job.id)
                moved = True
                if limits is not None:
                    limits.take(job, now + j.req[3])
                continue
            if slot is not None:
                cap.reserve(i, start, start + held[job.id], devices, job.cpus, job.memory, job.id)
                ahead = True
    return [j for j in deep if j.job.id in waiting]


def plan(nodes: Sequence[Node], running: Sequence[RunningJob], queued: Sequence[QueuedJob], now: float,
         policy: str = "e31", *, depth: int | None = None, age_limit_s: float = AGE_LIMIT_S,
         explain: bool = True, tenancy: Tenancy | None = None, profiles: dict | None = None) -> list[Placement]:
    """Plan ``queued`` onto ``nodes`` at ``now`` (Unix seconds), around the ``running`` jobs.

    ``policy``: ``e31``, ``fcfs``, ``easy`` or ``edf`` (module docstring).  ``depth``: how many
    waiting jobs get reservations (default :data:`DEPTH`; ``easy`` and ``edf`` always 1).
    ``age_limit_s``: the ageing bound of ``e31`` in seconds.  ``explain=False``: no reasons (a
    simulation needs only the decisions; they are the same).
    ``tenancy``: the pool's tenants (:mod:`.tenants`): jobs within their tenant's quota first, then
    borrowing ones, each by fair share; borrow limits held (None, or tenants that do not matter:
    the policy's order alone).  ``profiles``: a dict a replay keeps between plans for the nodes'
    capacity profiles (:class:`.capacity.Capacity`); the plan is the same with or without it.

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
    tenants = tenancy is not None and tenancy.matters()
    where = {node.name: i for i, node in enumerate(nodes)}
    cap = Capacity(nodes, running, now, profiles)
    jobs, refused, shapes, fits = [], [], {}, {}
    for job in queued:
        key = (job.gpu_type and job.gpu_type.lower(), job.gpus, job.cpus, job.memory)
        if key not in shapes:
            shapes[key] = eligible_nodes(nodes, job)
        shape = (job.gpu_type, job.gpus, job.cpus, job.memory, job.nodes)  # all the refusal's words depend on
        if shape not in fits:  # once per shape, not per job
            fits[shape] = fit_refusal(nodes, job, shapes[key])
        why = fits[shape] or deadline_refusal(job, now)
        if not why and tenants and exceeds_limit(job, tenancy):
            t = tenancy.of(job.tenant)
            why = (f"asks for more than tenant {job.tenant} may hold (its quota and borrow_limit: "
                   f"{amount_words(bounded(t))}); ask for less, or raise the tenant's borrow_limit in the pool file")
        if why:
            refused.append(Placement(job.id, "refuse", None, (), job.cpus, None, None, why, reserved=False))
        else:
            jobs.append(Ranked(job, shapes[key], where))
    promoted = overdue(jobs, now, age_limit_s) if policy == "e31" else {}
    for attempt in range(_PASSES if policy == "e31" else 1):
        if attempt:
            cap = Capacity(nodes, running, now, profiles)
        ranked = order(policy, jobs, now, promoted)
        if tenants:
            positions, nominal = fair_order([r.job for r in ranked], running, tenancy)
            ranked = [ranked[k] for k in positions]
        limits = BorrowLimits(running, tenancy, now) if tenants else None
        slots = _place(cap, ranked, depth, policy == "fcfs", promoted, limits)
        if policy != "e31" or attempt == _PASSES - 1:
            break
        risky = at_risk(jobs, {k: v[0] for k, v in slots.items()}, now, age_limit_s, promoted)
        if not risky:
            break
        promoted.update(risky)
    explainer = Explainer(cap, depth, policy == "fcfs") if explain else None
    held = limits.delayed if tenants and explain else {}
    out = [_placement(j, slots[j.job.id], cap, explainer, held.get(j.job.id)) for j in ranked]
    if tenants and explain:  # a borrowing job's wait: its tenant is beyond its quota
        words = beyond_quota(tenancy, running, [j.job for j in ranked], nominal)
        out = [replace(p, reason=f"{p.reason}; {words[p.job]}") if p.action == "wait" and p.job in words
               and p.job not in held else p for p in out]
    return out + refused


def _placement(j: Ranked, slot: _Slot, cap: Capacity, explainer: Explainer | None,
               limited: str | None = None) -> Placement:
    job, (start, i, devices, reserved, others) = j.job, slot
    node, end = cap.nodes[i].name, start + j.req[3]
    if others:  # a gang: its first node and devices, the others in ``gang``
        gang = tuple((cap.nodes[k].name, devices_of(mask)) for k, mask in others)
        parts = ((node, devices_of(devices)), *gang)
        action = "start" if start <= cap.now else "wait"
        if not explainer:
            why, shape = "", ""
        elif action == "start":
            why = shape = gang_start_reason(job, parts, end, cap.now)
        elif limited is not None:
            why = f"waiting: {limited}; planned to start {clock(start, cap.now)} on {len(parts)} nodes"
            shape = f"waiting: {limited}"
        else:
            why, shape = explainer.gang_words(job, j.eligible, [name for name, _ in parts], start, reserved)
        return Placement(job.id, action, node, devices_of(devices), job.cpus, start, end, why,
                         reserved if action == "wait" else True, None, shape if action == "wait" else "", gang)
    if start <= cap.now:
        why = start_reason(job, node, devices, end, cap.now) if explainer else ""
        return Placement(job.id, "start", node, devices_of(devices), job.cpus, start, end, why)
    if limited is not None:  # held back by its tenant's borrow limit, not by the room
        why = f"waiting: {limited}; planned to start {clock(start, cap.now)} on {node}"
        return Placement(job.id, "wait", node, devices_of(devices), job.cpus, start, end, why, reserved, None,
                         f"waiting: {limited}")
    why, shape, ender = explainer.words(job, j.eligible, i, start, reserved) if explainer else ("", "", None)
    return Placement(job.id, "wait", node, devices_of(devices), job.cpus, start, end, why, reserved, ender, shape)

