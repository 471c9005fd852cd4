"""The priority orders of the policies, and E31's promotions (see :mod:`.planner` for the policy).

A promotion says a job the plan fails goes ahead of the jobs ordered by
expansion factor, and by when it should start at the latest:

* a deadline job planned to end after its deadline: tier 0, ordered by deadline
  (EDF), to start by ``deadline - estimate - margin`` (the margin, 10% of the
  runtime estimate and at least 5 minutes, absorbs a small overrun), and by
  ``submitted + age limit`` at the latest;
* a job that has waited the age limit: tier 1, in arrival order, at once (not a job ordered by
  attained service: :mod:`.attained` has its own starvation bound).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from heapq import merge
from dataclasses import dataclass

from .attained import LEVELS_S, by_attained, rank
from .model import QueuedJob, id_order

__all__ = ["BSLD_FLOOR_S", "Promotion", "Ranked", "at_risk", "expansion_factor", "order", "overdue"]

#: The expansion factor counts a job shorter than this as this long (seconds), as bounded slowdown does.
BSLD_FLOOR_S = 10.0
#: Deadline margin: this fraction of the runtime estimate, and at least :data:`_MARGIN_MIN_S`.
_MARGIN = 0.10
_MARGIN_MIN_S = 300.0


@dataclass(frozen=True, order=True)
class Promotion:
    """Why a job goes ahead: ``tier`` 0 (deadline) or 1 (aged), ``key`` (its deadline, or when it
    reached the age limit), ``start_by`` (Unix seconds: the latest start the plan aims for)."""

    tier: int
    key: float
    start_by: float


class Ranked:
    """A queued job with what the planning passes need, computed once: ``req`` = (gpus, cpus,
    memory, seconds on the node by the estimate), ``hard`` = the same with the seconds it may hold
    the node at most (its limit), ``eligible`` (None: every node), ``kind`` (the GPU type, lower
    case), ``preferred`` (indices of nodes holding its inputs, then of its planned node)."""

    __slots__ = ("job", "req", "hard", "eligible", "kind", "preferred")

    def __init__(self, job: QueuedJob, eligible: list[bool], where: dict[str, int]) -> None:
        self.job = job
        self.req = (job.gpus, job.cpus, job.memory, job.occupancy_s)
        self.hard = (job.gpus, job.cpus, job.memory, job.hard_occupancy_s)
        self.eligible = None if all(eligible) else eligible
        self.kind = job.gpu_type.lower() if job.gpu_type else None
        # the planned node only as a tie-break: the wait a node holding the inputs is worth is theirs alone
        sticky = job.planned_node if job.planned_node and not job.locality_wait_s else None
        names = (*job.preferred_nodes, sticky) if sticky else job.preferred_nodes
        self.preferred = tuple(dict.fromkeys(where[n] for n in names if n in where and eligible[where[n]]))


def _arrival(j: Ranked) -> tuple[float, tuple[int, int, str]]:
    return j.job.submitted, id_order(j.job.id)


def expansion_factor(wait_s: float, estimate_s: float) -> float:
    """A waiting job's expansion factor: ``(wait + T) / T`` with ``T = max(estimate, 10 s)``
    (seconds in, a ratio >= 1 out).

    It is the slowdown the job would have if it started now, bounded as bounded slowdown bounds
    it (Feitelson, Rudolph, Schwiegelshohn, Sevcik & Wong 1997: runs under 10 s count as 10 s),
    with the bound applied to the run time in the numerator too.  Written as ``1 + wait / T`` it
    never grows with the estimate: at equal waits a shorter job's factor is at least as high
    (equal below 10 s, where the tie goes to the shorter job).  The form ``(wait + estimate) /
    max(estimate, 10 s)`` would rank a 9 s job ahead of a 2 s job that waited as long."""
    return 1.0 + max(wait_s, 0.0) / max(estimate_s, BSLD_FLOOR_S)


def order(policy: str, jobs: Sequence[Ranked], now: float, promoted: dict[str, Promotion]) -> list[Ranked]:
    """The jobs in ``policy``'s priority order (ties by submission time, then id; under ``e31`` jobs
    with equal expansion factors go shortest first)."""
    if policy in ("fcfs", "easy"):
        return sorted(jobs, key=_arrival)
    if policy == "edf":
        return sorted(jobs, key=lambda j: (j.job.deadline is None, j.job.work_deadline or 0.0, *_arrival(j)))
    first = sorted((j for j in jobs if j.job.id in promoted),
                   key=lambda j: (promoted[j.job.id].tier, promoted[j.job.id].key, *_arrival(j)))

    def expansion(j: Ranked) -> tuple:  # equal factors (jobs just submitted): the shorter first
        estimate = j.req[3]
        return (-expansion_factor(now - j.job.submitted, estimate), estimate, *_arrival(j))

    rest = [j for j in jobs if j.job.id not in promoted]
    served = sorted((j for j in rest if by_attained(j.job)), key=lambda j: (*rank(j.job, now), *_arrival(j)))
    if not served:
        return first + sorted(rest, key=expansion)
    return first + list(merge(sorted((j for j in rest if not by_attained(j.job)), key=expansion), served,
                              key=_as_estimated(now)))


def _as_estimated(now: float):
    """The key that interleaves jobs ordered by attained service with the others: each is ranked
    as a job whose estimate is the service left to the end of its level (in seconds of its width)
    that has waited since its current wait began.  Only the interleaving uses it: each list keeps
    its own order."""
    def key(j: Ranked) -> tuple:
        job = j.job
        if not by_attained(job):
            return (-expansion_factor(now - job.submitted, j.req[3]), j.req[3])
        fed, lvl = rank(job, now)  # fed 0: starving, ranked as a job about to end
        wide = max(job.gpus or job.cpus, 1)
        top = LEVELS_S[lvl] if lvl < len(LEVELS_S) else job.limit_s * wide
        estimate = max(top - job.attained_s, 0.0) / wide if fed else 0.0
        since = job.waiting_since if job.waiting_since is not None else job.submitted
        return (-expansion_factor(now - since, estimate), estimate)
    return key


def overdue(jobs: Iterable[Ranked], now: float, age_limit_s: float) -> dict[str, Promotion]:
    """The jobs that have waited ``age_limit_s`` seconds or more (tier 1, to start at once)."""
    return {j.job.id: Promotion(1, j.job.submitted + age_limit_s, now)
            for j in jobs if now - j.job.submitted >= age_limit_s and not by_attained(j.job)}


def at_risk(jobs: Iterable[Ranked], starts: dict[str, float], now: float, age_limit_s: float,
            promoted: dict[str, Promotion]) -> dict[str, Promotion]:
    """The promotions a plan with these ``starts`` (Unix seconds) calls for that ``promoted`` does
    not already hold (a new one replaces an old one only when it ranks higher)."""
    found = {}
    for j in jobs:
        job, start = j.job, starts[j.job.id]
        by = job.work_deadline  # the work ends by it, so the output is back by the deadline
        if by is not None and start + job.work_s > by:
            margin = max(_MARGIN * job.runtime_s, _MARGIN_MIN_S)
            new = Promotion(0, by, min(by - job.work_s - margin, job.submitted + age_limit_s))
        elif start > now and now - job.submitted >= age_limit_s and not by_attained(job):
            new = Promotion(1, job.submitted + age_limit_s, now)
        else:
            continue
        old = promoted.get(job.id)
        if old is None or new < old:
            found[job.id] = new
    return found
