"""Where a multi-node job (a gang) goes in one planning pass: :func:`place_gang`, the planner's rules for a
single-node job applied to all of a gang's nodes at once (:mod:`.planner` calls it; the search for nodes
that fit together is :func:`earliest_gang`)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from .capacity import Capacity, Request
from .policy import Promotion, Ranked

__all__ = ["earliest_gang", "place_gang"]


def place_gang(cap: Capacity, j: Ranked, promotion: Promotion | None, reservations: int, depth: int, after: float,
               blocked: bool, slack_use: float) -> tuple[float, list[tuple[int, int]], float] | None:
    """Where a multi-node job goes: ``(start, [(node index, device mask)] for its nodes, seconds held)``,
    or None when it only gets an estimate (beyond the planning depth and not startable now).  The rules
    of a single-node job, on all its nodes at once (:func:`earliest_gang`): a
    reservation at its earliest start for the first ``depth`` waiting jobs, so nothing backfilled
    behind it delays it (EASY's guarantee, held on every node of the gang); behind a reservation it
    starts now only on its limit; a promoted deadline job no earlier than needed (from ``slack_use`` of
    the way to its latest start, :data:`.planner.SLACK_USE`).  It is never started
    in room reserved for another job (a gang is not preempted), and it holds no node idle before its
    reserved start: every node is reserved from that start only, free for backfill until then."""
    now, count = cap.now, j.job.nodes
    if promotion is not None and promotion.start_by > now:
        by = promotion.start_by
        hit = earliest_gang(cap, j.req, count, j.eligible, now + slack_use * (by - now), by)
        if hit is not None:
            return hit[0], hit[1], j.req[3]
    if reservations < depth and reservations:  # behind a reservation: as the planner's ``_behind``
        if after <= now and (hit := earliest_gang(cap, j.hard, count, j.eligible, now, now)):
            return now, hit[1], j.hard[3]
        hit = earliest_gang(cap, j.req, count, j.eligible, after)
        if hit is not None and hit[0] <= now:  # its estimate fits now, its limit does not
            hit = earliest_gang(cap, j.hard, count, j.eligible, now + 1e-3)
        return None if hit is None else (hit[0], hit[1], j.req[3])
    if reservations < depth:
        hit = earliest_gang(cap, j.req, count, j.eligible, after)
        return None if hit is None else (hit[0], hit[1], j.req[3])
    if not blocked and (hit := earliest_gang(cap, j.hard, count, j.eligible, now, now)):
        return now, hit[1], j.hard[3]
    return None


def earliest_gang(cap: Capacity, req: Request, count: int, eligible: Sequence[bool] | None, after: float,
                  latest: float = float("inf")) -> tuple[float, list[tuple[int, int]]] | None:
    """On the capacity ``cap``: the earliest start ``t`` with ``after <= t <= latest`` at which ``req`` (per node) fits on
    ``count`` eligible nodes at once for its whole time, as ``(t, [(node index, device mask), ...])``
    with ``count`` nodes; None when there is none.  A gang starts on all its nodes together or not at
    all, as Slurm's multi-node allocations do.

    Which nodes: among those that fit at ``t``, the nodes of one group (:attr:`.model.Node.group`)
    when one group has enough of them (the group with the most such nodes, then pool order), then
    the nodes it leaves fewest devices free on, then pool order.

    How: each eligible node's earliest fit from ``after`` on is a lower bound; the ``count``-th
    smallest of them is the first time enough nodes could fit.  When fewer than ``count`` fit at
    that time exactly (a node's room closes before it), the search goes on from the next time
    capacity changes on an eligible node."""
    nodes = [i for i in range(len(cap.nodes)) if eligible is None or eligible[i]]
    if count < 1 or len(nodes) < count:
        return None
    t = after
    while t <= latest:
        firsts = sorted(hit[0] for i in nodes if (hit := cap.fit(i, req, t, latest)) is not None)
        if len(firsts) < count:
            return None
        at = firsts[count - 1]
        hits = [(i, hit[1]) for i in nodes if (hit := cap.fit(i, req, at, at)) is not None]
        if len(hits) >= count:
            return at, _choose_gang(cap, hits, count)
        later = None  # the next time capacity changes on an eligible node: within a segment a later
        for i in nodes:  # start only covers more of the profile, so it cannot fit where this one did not
            times = cap.times[i]
            k = bisect_right(times, at)
            if k < len(times) and (later is None or times[k] < later):
                later = times[k]
        if later is None:
            return None
        t = later
    return None

def _choose_gang(cap: Capacity, hits: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """``count`` of ``hits`` (``(node index, free device mask)``): one group's when it has enough
    (the largest such group, then the first in pool order), tightest fit first, then pool order."""
    groups: dict[str | None, list[tuple[int, int]]] = {}
    for hit in hits:
        groups.setdefault(cap.nodes[hit[0]].group, []).append(hit)
    whole = [(len(members), -members[0][0], name) for name, members in groups.items()
             if name is not None and len(members) >= count]
    pick = groups[max(whole)[2]] if whole else hits
    return sorted(pick, key=lambda h: (h[1].bit_count(), h[0]))[:count]
