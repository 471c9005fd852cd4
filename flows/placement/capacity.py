"""Free capacity of every node over time: earliest-fit search and reservations.

Each node has a step profile from ``now`` on: breakpoints ``times[0] = now <
times[1] < ...``; segment ``k`` is ``[times[k], times[k+1])`` (the last one
runs forever) and holds the node's free GPU devices as an int bitmask (bit d =
device d free), its free CPUs and free memory (BYTES).  A job gets whole
devices on ONE node: it fits at ``t`` for ``d`` seconds when, over every
segment the window ``[t, t+d)`` touches, the AND of the device masks keeps at
least ``gpus`` bits and the free CPUs and memory never drop below its request.
Reserving subtracts the job from those segments; it refuses (AssertionError)
anything that would oversubscribe.

Searching fast (the planner's budget is about 100 microseconds a job):

* a start is only tried where capacity rises (``now`` and the ends of jobs):
  if capacity did not rise, the previous start failed and this one fails too;
* a window that fails on a segment whose own CPUs, memory or device count are
  too small skips every start up to that segment;
* a per-GPU-count index ``(first time the node has g free devices, how many
  it has then, node)`` lets a search visit only nodes that could beat the best
  start found so far, tightest fit first; it is updated per reservation, only
  for the counts whose first time fell inside the reserved interval;
* a failed start-now check is remembered: capacity only shrinks during a
  plan, so a request at least as large fails too.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence
from itertools import islice
from dataclasses import replace

from .model import Node, PlanInputError, RunningJob

__all__ = ["Capacity", "Request"]

Request = tuple[int, int, int, float]  # gpus, cpus, memory (bytes), seconds on the node


def lowest_bits(mask: int, count: int) -> int:
    """The ``count`` lowest set bits of ``mask`` (the devices a job is given)."""
    out = 0
    for _ in range(count):
        low = mask & -mask
        out |= low
        mask ^= low
    return out


def devices_of(mask: int) -> tuple[int, ...]:
    """Device numbers of a bitmask, ascending."""
    return tuple(d for d in range(mask.bit_length()) if mask >> d & 1)


class Capacity:
    """The free-capacity profiles of a pool's nodes from ``now`` on (times in Unix seconds).

    Raises:
        PlanInputError: a running job on a node not in the pool, on a device
            the node lacks, on a device another running job holds, or taking
            more CPUs or memory than the node has.
    """

    def __init__(self, nodes: Sequence[Node], running: Sequence[RunningJob], now: float,
                 profiles: dict | None = None) -> None:
        """``profiles``: a dict kept by the caller between plans (a replay's), in which each node's profile
        is kept by its running jobs and reused while they all run on past ``now``: the same profile from a
        later ``now`` is the same but for its first time (building the profiles was three quarters of a
        replay's time).  None: built anew."""
        self.now = now
        self.nodes = list(nodes)
        where = {node.name: i for i, node in enumerate(self.nodes)}
        if len(where) != len(self.nodes):
            raise PlanInputError("two nodes of the pool have the same name")
        self.times: list[list[float]] = []
        self.masks: list[list[int]] = []
        self.cpus: list[list[int]] = []
        self.mems: list[list[int]] = []
        self.enders: list[dict[float, str]] = []  # end time -> the job that ends then (for reasons)
        per_node: list[list[RunningJob]] = [[] for _ in self.nodes]
        for job in running:
            for node, devices in job.parts:  # a gang holds its CPUs and memory on each of its nodes
                if node not in where:
                    raise PlanInputError(f"running job {job.id} is on node {node!r}, which is not in the pool")
                per_node[where[node]].append(job if node == job.node and not job.gang else
                                             replace(job, node=node, devices=devices, gang=()))
        if profiles is not None and len(profiles) > 8 * len(self.nodes):
            profiles.clear()  # bounded: the profiles of nodes whose jobs have since changed go
        for i, node in enumerate(self.nodes):
            jobs = per_node[i]
            jobs = sorted(jobs, key=lambda j: (self._end(j), j.id)) if len(jobs) > 1 else jobs
            key = None
            if profiles is not None and all(j.expected_end > now for j in jobs):
                key = (i, node, tuple((j.id, j.expected_end, j.devices, j.cpus, j.memory) for j in jobs))
                kept = profiles.get(key)
                if kept is not None:  # copies: a plan's reservations change its lists
                    times, masks, cpus, mems, enders = kept
                    self.times.append([now, *times[1:]])
                    self.masks.append(masks[:])
                    self.cpus.append(cpus[:])
                    self.mems.append(mems[:])
                    self.enders.append(dict(enders))
                    continue
            self._build(node, jobs)
            if key is not None:
                profiles[key] = (self.times[-1][:], self.masks[-1][:], self.cpus[-1][:], self.mems[-1][:],
                                 dict(self.enders[-1]))
        self.gmax = max((node.gpus for node in self.nodes), default=0)
        # where a job asking for no GPU is tried first: nodes with fewer GPUs (none first), then pool order; it
        # goes to the one with the fewest GPUs among those that start it as early (earliest, start_now), so GPU
        # nodes keep their CPUs and memory for the GPU jobs that need them (as Slurm's node weights are used)
        self.cpu_order = sorted(range(len(self.nodes)), key=lambda i: (self.nodes[i].gpus, i))
        self.first: list[list[tuple[float, int, int] | None]] = []
        self.index: list[list[tuple[float, int, int]]] = [[] for _ in range(self.gmax + 1)]
        for i, node in enumerate(self.nodes):
            self.first.append(self._first_free(i, node.gpus))
        for lst in self.index:
            lst.sort()
        self._failed: dict[str | None, list[Request]] = {}

    def _end(self, job: RunningJob) -> float:
        return job.expected_end if job.expected_end > self.now else self.now + 1.0

    def _build(self, node: Node, jobs: list[RunningJob]) -> None:
        used = cpus = mem = 0
        for job in jobs:
            mask = 0
            for d in job.devices:
                if not 0 <= d < node.gpus or mask >> d & 1:
                    raise PlanInputError(f"running job {job.id} holds GPU {d} of {node.name}, which has "
                                         f"{node.gpus} GPU(s) numbered from 0 (each device once)")
                mask |= 1 << d
            if used & mask:
                raise PlanInputError(f"running job {job.id} holds GPU(s) {list(devices_of(used & mask))} of "
                                     f"{node.name}, which another running job holds")
            used |= mask
            cpus += job.cpus
            mem += job.memory
        if cpus > node.cpus or mem > node.memory:
            raise PlanInputError(f"the running jobs on {node.name} hold more CPUs or memory than it has "
                                 f"({cpus} CPUs, {mem} bytes of {node.cpus}, {node.memory})")
        full = (1 << node.gpus) - 1
        times, masks, fc, fm, enders = [self.now], [full & ~used], [node.cpus - cpus], [node.memory - mem], {}
        for job in jobs:
            end = self._end(job)
            if end != times[-1]:
                times.append(end)
                masks.append(masks[-1])
                fc.append(fc[-1])
                fm.append(fm[-1])
                enders[end] = job.id
            masks[-1] |= sum(1 << d for d in job.devices)
            fc[-1] += job.cpus
            fm[-1] += job.memory
        self.times.append(times)
        self.masks.append(masks)
        self.cpus.append(fc)
        self.mems.append(fm)
        self.enders.append(enders)

    def _first_free(self, i: int, gpus: int) -> list[tuple[float, int, int] | None]:
        """Node ``i``'s first-free entries ``(time, free GPUs then, i)`` for 1..``gpus`` GPUs, each also
        appended to :attr:`index` (sorted once all nodes are in): what :meth:`_index` keeps up to date, built
        in one pass over the node's profile."""
        first: list[tuple[float, int, int] | None] = [None] * (gpus + 1)
        times, masks, index = self.times[i], self.masks[i], self.index
        g = 1
        for k, mask in enumerate(masks):
            pop = mask.bit_count()
            while g <= pop:
                first[g] = entry = (times[k], pop, i)
                index[g].append(entry)
                g += 1
            if g > gpus:
                return first
        while g <= gpus:  # past every segment the node is whole
            first[g] = entry = (times[-1], gpus, i)
            index[g].append(entry)
            g += 1
        return first

    def _index(self, i: int, counts, start_seg: int) -> None:
        """Recompute node ``i``'s first-free entries for GPU ``counts`` from segment ``start_seg`` on."""
        todo = sorted(counts)
        if not todo:
            return
        times, masks, first = self.times[i], self.masks[i], self.first[i]
        k = start_seg
        while todo:
            pop = masks[k].bit_count() if k < len(masks) else self.nodes[i].gpus
            t = times[k] if k < len(times) else times[-1]
            while todo and todo[0] <= pop:
                g = todo.pop(0)
                old, new = first[g], (t, pop, i)
                if old != new:
                    lst = self.index[g]
                    if old is not None:
                        del lst[bisect_left(lst, old)]
                        insort(lst, new)
                    else:
                        lst.append(new)  # sorted once when built
                    first[g] = new
            k += 1

    # -- queries ------------------------------------------------------------

    def tail(self, i: int) -> float:
        """When node ``i`` is last touched by a job: from then on it is entirely free (Unix seconds)."""
        return self.times[i][-1]

    def free_now(self, i: int) -> tuple[int, int, int]:
        """(free GPUs, free CPUs, free memory in bytes) of node ``i`` at ``now``, reservations included."""
        return self.masks[i][0].bit_count(), self.cpus[i][0], self.mems[i][0]

    def ender(self, i: int, t: float) -> str | None:
        """The job that ends on node ``i`` at ``t`` (a running or a planned one), if any."""
        return self.enders[i].get(t)

    def fit(self, i: int, req: Request, after: float, latest: float) -> tuple[float, int] | None:
        """The earliest start ``t`` on node ``i`` with ``after <= t <= latest`` where ``req`` fits,
        as ``(t, free device mask over the window)``; None when there is none."""
        g, c, m, d = req
        times, masks, cpus, mems = self.times[i], self.masks[i], self.cpus[i], self.mems[i]
        n = len(times)
        s0 = s = bisect_right(times, after) - 1
        while s < n:
            t = times[s] if times[s] > after else after
            if t > latest:
                return None
            mask = masks[s]
            if mask.bit_count() < g or cpus[s] < c or mems[s] < m:
                s += 1
                continue
            if s > s0 and not (mask & ~masks[s - 1] or cpus[s] > cpus[s - 1] or mems[s] > mems[s - 1]):
                s += 1  # capacity did not rise: the start before failed, so does this one
                continue
            end, j, nxt = t + d, s + 1, 0
            while j < n and times[j] < end:
                if cpus[j] < c or mems[j] < m or masks[j].bit_count() < g:
                    nxt = j + 1
                    break
                mask &= masks[j]
                if mask.bit_count() < g:
                    nxt = s + 1
                    break
                j += 1
            if not nxt:
                return t, mask
            s = nxt
        return None

    def earliest(self, req: Request, eligible: Sequence[bool] | None, after: float, latest: float = float("inf"),
                 preferred: Sequence[int] = (), wait_s: float = 0.0) -> tuple[float, int, int] | None:
        """The earliest ``(start, node index, device mask)`` for ``req`` with ``after <= start <=
        latest`` on an eligible node (``eligible[i]``; None: every node).  Among nodes where it can start
        equally early: ``preferred`` nodes first; a job asking for no GPU, the nodes with the fewest GPUs
        (Slurm's node weights are used so: GPU nodes keep their CPUs and memory for GPU work); then the
        node whose entirely-free time it pushes back least (so nodes drain whole for wide jobs), then the
        fewest free devices, then pool order.  A
        preferred node also wins over others that start it at most ``wait_s`` seconds sooner.
        None when there is no such start."""
        best, found = latest, None
        for i in preferred:
            hit = self.fit(i, req, after, best)
            if hit is not None and (found is None or hit[0] < best):
                best, found = hit[0], (hit[0], i, hit[1])
        if found is not None and (best == after or best - wait_s <= after):
            return found
        if found is not None and wait_s > 0:
            best -= wait_s  # another node wins only by starting it more than wait_s sooner
        g, d = req[0], req[3]
        if g == 0:
            order = ((after, 0, i) for i in self.cpu_order)
        elif g > self.gmax:
            return found
        else:
            order = iter(self.index[g])
        times, rank, nodes = self.times, None, self.nodes
        for t, _, i in order:
            if t > best or t == best and rank is not None and rank[2] == 0.0:
                break  # no node further on can start it earlier, or as early and fit better
            if eligible is not None and not eligible[i]:
                continue
            hit = self.fit(i, req, t if t > after else after, best)
            if hit is None or found is not None and rank is None and hit[0] >= best:
                continue  # a preferred node already starts it as early
            score = (hit[0], nodes[i].gpus if g == 0 else 0, max(0.0, hit[0] + d - times[i][-1]))
            if rank is None or score < rank:
                best, found, rank = hit[0], (hit[0], i, hit[1]), score
        return found

    def start_now(self, req: Request, eligible: Sequence[bool] | None, kind: str | None,
                  preferred: Sequence[int] = ()) -> tuple[int, int] | None:
        """``(node index, device mask)`` where ``req`` fits from ``now`` for its whole time without
        touching any reservation (chosen as :meth:`earliest` chooses); None otherwise.  ``kind``
        keys the memory of failures (requests with the same eligibility share it)."""
        g, c, m, d = req
        failed = self._failed.setdefault(kind, [])
        for fg, fc, fm, fd in failed:
            if fg <= g and fc <= c and fm <= m and fd <= d:
                return None
        now = self.now
        for i in preferred:
            hit = self.fit(i, req, now, now)
            if hit is not None:
                return i, hit[1]
        if g == 0:
            candidates = self.cpu_order
        else:
            # the index is sorted by first-free time: those free by now are a prefix of it
            lst = self.index[g] if g <= self.gmax else []
            candidates = (i for _, _, i in islice(lst, bisect_right(lst, (now, math.inf, math.inf))))
        times, found, rank = self.times, None, None
        for i in candidates:  # a job asking for no GPU: the nodes with the fewest GPUs first (cpu_order)
            if eligible is not None and not eligible[i]:
                continue
            hit = self.fit(i, req, now, now)
            if hit is not None:
                score = (self.nodes[i].gpus if g == 0 else 0, max(0.0, now + d - times[i][-1]))
                if rank is None or score < rank:
                    found, rank = (i, hit[1]), score
                    if score[1] == 0.0:
                        break  # no node further on has fewer GPUs and fits better
        if found is None:
            failed.append(req)
        return found

    # -- changes ------------------------------------------------------------

    def _split(self, i: int, t: float) -> int:
        """Index of the segment starting at ``t`` on node ``i``, splitting the one containing it."""
        times = self.times[i]
        k = bisect_right(times, t) - 1
        if times[k] == t:
            return k
        times.insert(k + 1, t)
        for lst in (self.masks[i], self.cpus[i], self.mems[i]):
            lst.insert(k + 1, lst[k])
        return k + 1

    def reserve(self, i: int, start: float, end: float, devices: int, cpus: int, memory: int, label: str) -> None:
        """Take ``devices`` (bitmask), ``cpus`` and ``memory`` (bytes) of node ``i`` over ``[start, end)``
        for job ``label``.  Raises AssertionError if that would oversubscribe the node (a planner bug)."""
        assert self.now <= start < end
        a = self._split(i, start)
        b = self._split(i, end)
        masks, fc, fm = self.masks[i], self.cpus[i], self.mems[i]
        keep = ~devices
        for k in range(a, b):
            assert masks[k] & devices == devices and fc[k] >= cpus and fm[k] >= memory, "oversubscribed"
            masks[k] &= keep
            fc[k] -= cpus
            fm[k] -= memory
        self.enders[i].setdefault(end, label)
        first = self.first[i]
        self._index(i, [g for g in range(1, len(first)) if start <= first[g][0] < end], a)

    def release(self, i: int, start: float, end: float, devices: int, cpus: int, memory: int, label: str) -> None:
        """Give back what :meth:`reserve` took on node ``i`` over ``[start, end)`` for job ``label`` (the
        same arguments).  Capacity grows: the memory of failed start-now checks is cleared."""
        a = self._split(i, start)
        b = self._split(i, end)
        masks, fc, fm = self.masks[i], self.cpus[i], self.mems[i]
        for k in range(a, b):
            masks[k] |= devices
            fc[k] += cpus
            fm[k] += memory
        if self.enders[i].get(end) == label:
            del self.enders[i][end]
        first = self.first[i]
        self._index(i, [g for g in range(1, len(first)) if first[g][0] >= start], a)
        self._failed.clear()

    def room_until(self, i: int, req: Request) -> float:
        """How long from ``now`` ``req`` fits on node ``i`` unbroken: the Unix time the window first
        fails (``now`` when it does not fit at ``now``; infinity when it fits forever)."""
        g, c, m, _ = req
        times, masks, cpus, mems = self.times[i], self.masks[i], self.cpus[i], self.mems[i]
        mask = masks[0]
        for k in range(len(times)):
            mask &= masks[k]
            if mask.bit_count() < g or cpus[k] < c or mems[k] < m:
                return times[k]
        return float("inf")
