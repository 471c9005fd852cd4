"""Where a multi-node job (a gang) goes in one planning pass: :func:`place_gang`, the planner's rules for a
single-node job applied to all of a gang's nodes at once (:mod:`.planner` calls it; the search for nodes
that fit together is :meth:`.capacity.Capacity.earliest_gang`)."""

from __future__ import annotations

from .capacity import Capacity
from .policy import Promotion, Ranked

__all__ = ["place_gang"]


def place_gang(cap: Capacity, j: Ranked, promotion: Promotion | None, reservations: int, depth: int, after: float,
               blocked: bool, slack_use: float) -> tuple[float, list[tuple[int, int]], float] | None:
    """Where a multi-node job goes: ``(start, [(node index, device mask)] for its nodes, seconds held)``,
    or None when it only gets an estimate (beyond the planning depth and not startable now).  The rules
    of a single-node job, on all its nodes at once (:meth:`.capacity.Capacity.earliest_gang`): a
    reservation at its earliest start for the first ``depth`` waiting jobs, so nothing backfilled
    behind it delays it (EASY's guarantee, held on every node of the gang); behind a reservation it
    starts now only on its limit; a promoted deadline job no earlier than needed (from ``slack_use`` of
    the way to its latest start, :data:`.planner.SLACK_USE`).  It is never started
    in room reserved for another job (a gang is not preempted), and it holds no node idle before its
    reserved start: every node is reserved from that start only, free for backfill until then."""
    now, count = cap.now, j.job.nodes
    if promotion is not None and promotion.start_by > now:
        by = promotion.start_by
        hit = cap.earliest_gang(j.req, count, j.eligible, now + slack_use * (by - now), by)
        if hit is not None:
            return hit[0], hit[1], j.req[3]
    if reservations < depth and reservations:  # behind a reservation: as the planner's ``_behind``
        if after <= now and (hit := cap.earliest_gang(j.hard, count, j.eligible, now, now)):
            return now, hit[1], j.hard[3]
        hit = cap.earliest_gang(j.req, count, j.eligible, after)
        if hit is not None and hit[0] <= now:  # its estimate fits now, its limit does not
            hit = cap.earliest_gang(j.hard, count, j.eligible, now + 1e-3)
        return None if hit is None else (hit[0], hit[1], j.req[3])
    if reservations < depth:
        hit = cap.earliest_gang(j.req, count, j.eligible, after)
        return None if hit is None else (hit[0], hit[1], j.req[3])
    if not blocked and (hit := cap.earliest_gang(j.hard, count, j.eligible, now, now)):
        return now, hit[1], j.hard[3]
    return None
