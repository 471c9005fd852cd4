"""Tenants in the plan: quotas, borrowing and fair share (pure, no IO).

A pool's tenants (the pool file's ``tenants:``, :mod:`e31.specs.tenants`) share its nodes.  The planner
orders the queue in two classes, then by fair share:

* **Within quota first.**  Taking each tenant's jobs in the policy's own order (deadlines, ageing,
  expansion factor, attained service: :mod:`.policy`), a job is *nominal* while its tenant's running
  jobs and its jobs ordered before it, with it, fit the tenant's ``quota`` in every resource; from the
  first that does not, its tenant's jobs *borrow*.  Every nominal job is ordered before every borrowing
  one (Kueue admits a ClusterQueue's workloads within its nominal quota before any borrowing from the
  cohort).  A tenant with no quota (``default`` unless declared) only borrows.
* **Fair share among tenants.**  Within each class the next job comes from the tenant with the lowest
  ``(history + allocation) / weight``, each a dominant share (Ghodsi et al., "Dominant Resource
  Fairness", NSDI 2011: the largest of the shares of GPUs, CPUs and memory): ``history``, its past usage
  decayed with the pool's half-life (:func:`decayed_service`; Slurm's fair share decays usage so,
  ``PriorityDecayHalfLife``) over all tenants' decayed usage together (Slurm's effective usage);
  ``allocation``, what its running jobs and its jobs ordered so far hold, over the pool.  Each job ordered adds its request
  to its tenant's allocation (progressive filling), so tenants' jobs interleave in proportion to their
  weights rather than one tenant's whole queue going first.
* **Borrow limit.**  A job that would take its tenant past ``quota + borrow_limit`` while its tenant's
  running jobs hold what they hold does not start now: it starts no earlier than the planned end of
  enough of them (:class:`BorrowLimits`); one that alone asks for more is refused.
* **Reclaim.**  A tenant's running jobs beyond its quota (the latest started first) are *borrowing*
  (:func:`borrowing`); a nominal job that waits may preempt borrowing jobs of other tenants, preemptible
  ones only, the pool's minimum run holding (:func:`e31.flows.placement.preemption.plan_preemptions`).

With one tenant (or none declared), nothing changes: the planner's order is the policy's.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Sequence
from typing import Any
from dataclasses import dataclass, field

from .model import QueuedJob, RunningJob

__all__ = ["BorrowLimits", "Tenancy", "Tenant", "tenancy_of", "borrowing", "decayed_service", "dominant_share", "exceeds_limit",
           "amount_words", "beyond_quota", "bounded", "fair_order", "held_by", "sum_of"]

Amount = tuple[float, float, float]  # GPUs, CPUs, memory bytes (or the same times seconds)
_NONE: Amount = (0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Tenant:
    """One tenant as the planner sees it: ``quota`` and ``borrow_limit`` as ``(gpus, cpus, memory
    bytes)`` (``borrow_limit`` None: any), ``weight`` (> 0), ``usage`` (its decayed past usage, as
    ``(GPU-seconds, CPU-seconds, byte-seconds)``, :func:`decayed_service`)."""

    name: str
    quota: Amount = _NONE
    weight: float = 1.0
    borrow_limit: Amount | None = None
    usage: Amount = _NONE


@dataclass(frozen=True)
class Tenancy:
    """The pool's tenants (by name; a job of a tenant not listed counts as one with no quota and a
    weight of 1), the pool's ``capacity`` ``(gpus, cpus, memory bytes)`` and the usage ``half_life_s``."""

    tenants: dict[str, Tenant] = field(default_factory=dict)
    capacity: Amount = _NONE
    half_life_s: float = 7 * 86400.0

    def of(self, name: str) -> Tenant:
        """The tenant ``name`` (an undeclared one: no quota, weight 1, no usage)."""
        return self.tenants.get(name) or Tenant(name)

    def matters(self) -> bool:
        """Whether tenants change the plan: two or more declared, or one with a quota or a limit."""
        return len(self.tenants) > 1 or any(t.quota != _NONE or t.borrow_limit is not None
                                            for t in self.tenants.values())


def dominant_share(amount: Amount, capacity: Amount) -> float:
    """The largest of ``amount``'s shares of ``capacity`` (resource by resource; a resource the pool
    lacks counts 0)."""
    return max((a / c for a, c in zip(amount, capacity) if c > 0), default=0.0)


def decayed_service(held: Amount, start: float, end: float, now: float, half_life_s: float) -> Amount:
    """The usage ``held`` (GPUs, CPUs, bytes) from ``start`` to ``end`` (Unix seconds) counts at ``now``,
    each moment weighted ``2 ** (-(now - t) / half_life_s)``: resource-seconds, the integral
    ``held * H / ln 2 * (2**(-(now-end)/H) - 2**(-(now-start)/H))``."""
    end, start = min(end, now), min(start, now)
    if end <= start:
        return _NONE
    scale = half_life_s / math.log(2) * (2 ** (-(now - end) / half_life_s) - 2 ** (-(now - start) / half_life_s))
    return tuple(h * scale for h in held)  # type: ignore[return-value]


def _history(tenant: Tenant, total: Amount) -> float:
    """The tenant's decayed usage as a dominant share of all tenants' decayed usage ``total`` (Slurm's
    effective usage: a tenant's usage over its siblings' together); 0 before anyone used anything."""
    return dominant_share(tenant.usage, total)


def _add(a: Amount, b: Amount) -> Amount:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


def _within(a: Amount, bound: Amount) -> bool:
    return all(x <= y for x, y in zip(a, bound))


def _request(job: QueuedJob) -> Amount:
    n = job.nodes  # a multi-node job asks for its request on each node
    return float(job.gpus * n), float(job.cpus * n), float(job.memory * n)


def _holding(job: RunningJob) -> Amount:
    n = 1 + len(job.gang)
    return float(job.gpus_held), float(job.cpus * n), float(job.memory * n)


def held_by(running: Iterable[RunningJob]) -> dict[str, Amount]:
    """What each tenant's running jobs hold, ``(gpus, cpus, memory bytes)``."""
    out: dict[str, Amount] = {}
    for job in running:
        out[job.tenant] = _add(out.get(job.tenant, _NONE), _holding(job))
    return out


def borrowing(running: Sequence[RunningJob], tenancy: Tenancy) -> set[str]:
    """The running jobs that hold their tenant's resources beyond its quota: for each tenant, its
    running jobs by start (then id) fill its quota; every one from the first that does not fit is
    borrowing (the latest started give way first, as a reclaim takes them)."""
    out: set[str] = set()
    used: dict[str, Amount] = {}
    for job in sorted(running, key=lambda j: (j.start, j.id)):
        total = _add(used.get(job.tenant, _NONE), _holding(job))
        used[job.tenant] = total
        if not _within(total, tenancy.of(job.tenant).quota):
            out.add(job.id)
    return out


def fair_order(jobs: Sequence[QueuedJob], running: Sequence[RunningJob], tenancy: Tenancy) -> tuple[list[int], set[str]]:
    """The order of ``jobs`` (given in the policy's order) among tenants, as positions into ``jobs``,
    and the ids of the nominal ones (module docstring): nominal jobs first, then borrowing ones, each
    class by progressive filling on ``(history + allocation) / weight`` (ties: the tenant whose next job
    comes first in the policy's order).  Each tenant's own jobs keep the policy's order."""
    held = held_by(running)
    queues: dict[str, list[int]] = {}
    for index, job in enumerate(jobs):
        queues.setdefault(job.tenant, []).append(index)
    nominal: set[str] = set()
    classes: tuple[dict[str, list[int]], dict[str, list[int]]] = ({}, {})
    for name, positions in queues.items():
        quota, used = tenancy.of(name).quota, held.get(name, _NONE)
        within = True
        for index in positions:
            used = _add(used, _request(jobs[index]))
            within = within and _within(used, quota)
            classes[0 if within else 1].setdefault(name, []).append(index)
            if within:
                nominal.add(jobs[index].id)
    allocation = dict(held)
    total = sum_of(tenancy.of(name).usage for name in {*tenancy.tenants, *queues})
    out: list[int] = []
    history = {name: _history(tenancy.of(name), total) for name in queues}
    for queued in classes:
        # only the tenant just served changes its key: a heap of every tenant's next job, O(jobs x log tenants)
        def key(name: str, head: int) -> tuple[float, int, str, int]:
            share = history[name] + dominant_share(allocation.get(name, _NONE), tenancy.capacity)
            return share / tenancy.of(name).weight, queued[name][head], name, head

        heap = [key(name, 0) for name in queued]
        heapq.heapify(heap)
        while heap:
            _, index, name, head = heapq.heappop(heap)
            out.append(index)
            allocation[name] = _add(allocation.get(name, _NONE), _request(jobs[index]))
            if head + 1 < len(queued[name]):
                heapq.heappush(heap, key(name, head + 1))
    return out, nominal


class BorrowLimits:
    """Each tenant's bound ``quota + borrow_limit`` during one planning pass: what its running jobs
    hold, plus what the pass starts now (:meth:`take`).  Tenants without a ``borrow_limit`` are not
    bounded."""

    def __init__(self, running: Sequence[RunningJob], tenancy: Tenancy, now: float) -> None:
        self.tenancy, self.now = tenancy, now
        self.held = held_by(running)
        self.ends: dict[str, list[tuple[float, Amount]]] = {}
        for r in running:
            self.ends.setdefault(r.tenant, []).append((max(r.expected_end, now + 1.0), _holding(r)))
        for ends in self.ends.values():
            ends.sort()
        self.delayed: dict[str, str] = {}  # job id -> why its tenant's limit holds it back (words)
        self.pending: dict[str, list[tuple[float, Amount]]] = {}  # tenant -> (planned end, request) of held jobs

    def _bound(self, tenant: str) -> Amount | None:
        t = self.tenancy.of(tenant)
        return None if t.borrow_limit is None else _add(t.quota, t.borrow_limit)

    def allows(self, job: QueuedJob) -> bool:
        """Whether ``job`` may start now: its tenant stays within its bound with it."""
        bound = self._bound(job.tenant)
        return bound is None or _within(_add(self.held.get(job.tenant, _NONE), _request(job)), bound)

    def take(self, job: QueuedJob, end: float) -> None:
        """``job`` starts now and is planned to end at ``end`` (Unix seconds): its request counts against
        its tenant's bound for the rest of the pass, and frees it at ``end`` (:meth:`after`)."""
        self.held[job.tenant] = _add(self.held.get(job.tenant, _NONE), _request(job))
        bisect.insort(self.ends.setdefault(job.tenant, []), (max(end, self.now + 1.0), _request(job)))

    def hold(self, job: QueuedJob, end: float | None = None) -> None:
        """``job`` is held back by its tenant's bound: say so (:attr:`delayed`); ``end`` (Unix seconds): the
        end of the later start the plan gave it, which the tenant's next held jobs wait for as if it held
        its room from now (:meth:`after`: held jobs never share a planned start their bound cannot hold)."""
        if end is not None:
            bisect.insort(self.pending.setdefault(job.tenant, []), (end, _request(job)))
        t = self.tenancy.of(job.tenant)
        used, more, bound = self.held.get(job.tenant, _NONE), _request(job), bounded(t)
        past = _past(used, more, bound)  # only the resources the job would take past the bound
        used, more, bound = _only(used, past), _only(more, past), _only(bound, past)
        self.delayed[job.id] = (f"tenant {job.tenant} holds {amount_words(used)}, and {amount_words(more)} "
                                f"more would pass its quota and borrow_limit ({amount_words(bound)}); it starts "
                                "as the tenant's running jobs end")

    def after(self, job: QueuedJob) -> float:
        """The earliest time ``job`` fits its tenant's bound as its tenant's running jobs, the jobs this
        pass starts now and the jobs it held back (:meth:`hold`) end (their planned ends, earliest first):
        Unix seconds, ``now + 1`` at the least; ``math.inf`` when the job alone exceeds the bound."""
        bound = self._bound(job.tenant)
        if bound is None:
            return self.now
        if not _within(_request(job), bound):
            return math.inf
        pending = self.pending.get(job.tenant, [])
        used = _add(sum_of((self.held.get(job.tenant, _NONE), *(h for _, h in pending))), _request(job))
        last = self.now + 1.0
        for end, holding in heapq.merge(self.ends.get(job.tenant, []), pending):
            used = tuple(u - h for u, h in zip(used, holding))  # type: ignore[assignment]
            last = end
            if _within(used, bound):
                return end
        return last


def within_bound(job: QueuedJob, held: Iterable[RunningJob], tenancy: Tenancy | None) -> bool:
    """Whether ``job`` may start beside ``held`` (running jobs and jobs started this plan) without taking its
    tenant past ``quota + borrow_limit``: a preemption for it must not do what the plan itself would not
    (:class:`BorrowLimits`).  True without tenants or a borrow limit."""
    if tenancy is None:
        return True
    tenant = tenancy.of(job.tenant)
    if tenant.borrow_limit is None:
        return True
    used = sum_of(_holding(r) for r in held if r.tenant == job.tenant)
    return _within(_add(used, _request(job)), _add(tenant.quota, tenant.borrow_limit))


def beyond_quota(tenancy: Tenancy, running: Sequence[RunningJob], jobs: Sequence[QueuedJob],
                 nominal: set[str]) -> dict[str, str]:
    """For each of ``jobs`` not in ``nominal`` (it borrows: its tenant's quota is full without it), what
    its waiting reason adds: its tenant, what its running jobs hold, its jobs within the quota and its
    borrowing jobs ahead of this one are planned, and its quota, e.g. ``tenant vision is at its quota (16 GPUs held or planned, quota 16
    GPUs): its jobs beyond it wait behind jobs within their tenants' quotas``; for a tenant without a
    quota, that it has none."""
    held = held_by(running)
    for job in jobs:  # what the plan gives each tenant within its quota
        if job.id in nominal:
            held[job.tenant] = _add(held.get(job.tenant, _NONE), _request(job))
    out = {}
    for job in jobs:
        if job.id in nominal:
            continue
        used = held.get(job.tenant, _NONE)
        held[job.tenant] = _add(used, _request(job))  # a borrowing job ahead counts for its tenant's next ones
        t = tenancy.of(job.tenant)
        if t.quota == _NONE:
            out[job.id] = (f"tenant {job.tenant} has no quota: its jobs run in capacity no tenant within its quota "
                           "needs, ordered by fair share")
        elif not _within(_request(job), t.quota):
            out[job.id] = (f"it asks for more than tenant {job.tenant}'s quota ({amount_words(t.quota)}) alone: "
                           "it runs in capacity no tenant within its quota needs, ordered by fair share")
        else:
            past = _past(used, _request(job), t.quota)  # the resources this job would take past the quota
            where = ("is over its quota" if any(used[i] > t.quota[i] for i in past)
                     else "is at its quota" if any(used[i] == t.quota[i] for i in past)
                     else "would pass its quota with this job")
            out[job.id] = (f"tenant {job.tenant} {where} ({_of_words(used, t.quota, past)} held or planned): its "
                           "jobs beyond it wait behind jobs within their tenants' quotas")
    return out


def _past(used: Amount, more: Amount, bound: Amount) -> tuple[int, ...]:
    """The resources (0: GPUs, 1: CPUs, 2: memory) that ``used + more`` takes past ``bound``."""
    return tuple(i for i in range(3) if used[i] + more[i] > bound[i])


def _only(amount: Amount, which: tuple[int, ...]) -> Amount:
    """``amount`` with the resources not in ``which`` left out (0)."""
    return tuple(a if i in which else 0.0 for i, a in enumerate(amount))  # type: ignore[return-value]


def _of_words(used: Amount, limit: Amount, which: tuple[int, ...]) -> str:
    """``4 of 4 GPUs, 40 of 32 CPUs``: ``used`` against ``limit`` for the resources ``which``."""
    units = ("GPUs", "CPUs", "GiB")
    scale = (1.0, 1.0, 1024.0 ** 3)
    return ", ".join(f"{used[i] / scale[i]:g} of {limit[i] / scale[i]:g} {units[i]}" for i in which) or "nothing"


def bounded(tenant: Tenant) -> Amount:
    """What ``tenant`` may hold at most: ``quota + borrow_limit`` (``inf`` where there is no limit)."""
    return _add(tenant.quota, tenant.borrow_limit) if tenant.borrow_limit is not None else (math.inf,) * 3


def exceeds_limit(job: QueuedJob, tenancy: Tenancy) -> bool:
    """Whether ``job`` alone asks for more than its tenant's ``quota + borrow_limit``: it can never run."""
    tenant = tenancy.of(job.tenant)
    return tenant.borrow_limit is not None and not _within(_request(job), _add(tenant.quota, tenant.borrow_limit))


def sum_of(amounts: Iterable[Amount]) -> Amount:
    """The sum of ``amounts`` resource by resource."""
    total = _NONE
    for a in amounts:
        total = _add(total, a)
    return total


def _named(amount: Amount, bound: Amount) -> Amount:
    """``amount`` with the resources ``bound`` does not limit (``inf``) left out (0): what words show."""
    return tuple(a if b < math.inf else 0.0 for a, b in zip(amount, bound))  # type: ignore[return-value]


def amount_words(amount: Amount) -> str:
    """An amount in words, resources of 0 or without a limit left out: ``4 GPUs, 16 CPUs``, ``1 GPU``."""
    parts = [f"{int(amount[0])} GPU{'' if int(amount[0]) == 1 else 's'}" if 0 < amount[0] < math.inf else "",
             f"{int(amount[1])} CPU{'' if int(amount[1]) == 1 else 's'}" if 0 < amount[1] < math.inf else "",
             f"{amount[2] / 1024**3:g} GiB" if 0 < amount[2] < math.inf else ""]
    return ", ".join(p for p in parts if p) or "nothing"


def tenancy_of(pool: Any, usage: dict[str, Amount] | None = None) -> Tenancy:
    """The planner's :class:`Tenancy` of a pool file (a :class:`e31.specs.pool.PoolSpec`): its tenants'
    quotas, weights and borrow limits, its capacity (every node's GPUs, CPUs and memory), its
    ``fair_share.half_life``; ``usage``: each tenant's decayed usage (default none)."""
    usage = usage or {}
    tenants = {t.name: Tenant(t.name, tuple(float(x) for x in t.quota.as_tuple()), float(t.weight),
                              t.borrow_limit.as_tuple() if t.borrow_limit is not None else None,
                              usage.get(t.name, _NONE))
               for t in pool.tenants}
    for name, used in usage.items():
        tenants.setdefault(name, Tenant(name, usage=used))
    capacity = sum_of((float(line.gpus * line.count), float(line.cpus * line.count), float(line.memory * line.count))
                      for line in pool.nodes)
    return Tenancy(tenants, capacity, pool.fair_share.half_life.total_seconds())
