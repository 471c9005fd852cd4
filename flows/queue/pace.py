"""How often the scheduler rewrites a waiting run's reason and scheduled
time: the soonest few exact, the rest told less and less often.

With a deep queue every job's end moves the plan (start, node, the job
waited for) of every waiting run, and each rewrite is a state write, two
reads and an event on the Prefect server the running jobs need.  The rules
here decide which moves are worth a write; :func:`e31.flows.queue.record.apply`
applies them.  Times are seconds.
"""

from __future__ import annotations

import re
from datetime import datetime

from e31.flows.queue.mapping import AHEAD_S

#: A clock time as :func:`e31.flows.placement.text.clock` writes it: ``02:40:05 UTC``, ``02:40 UTC`` (a
#: whole minute), with the date before it when not today's.
_CLOCK = re.compile(r"(?:\d{4}-\d\d-\d\d )?\d\d:\d\d(?::\d\d)? UTC")


#: Waiting runs, soonest planned start first, whose reason and planned start every tick keeps exact; each
#: later one is rewritten at most once per REASON_EVERY_S seconds (counted ``kept`` meanwhile), and before
#: its scheduled time comes within AHEAD_S / 4 of now: with a deep queue every run's end moves the plan
#: (node, the job it waits for) of every waiting run, and rewriting them loaded the server the running
#: jobs need (a state write, two reads and an event each; 25 and 60 s: 2.4 writes per job in a 1,000-job
#: bench_queue run).
REASON_DEPTH = 5
REASON_EVERY_S = 120.0
#: The same for a waiting run beyond the planner's reservations, whose start is an estimate ("estimated
#: start ... not reserved"): at most once per ten minutes.
ESTIMATE_EVERY_S = 600.0
#: Beyond the REASON_DEPTH soonest, a waiting run's scheduled time is at least this far ahead (its planned
#: start when later), so keeping it ahead of Prefect's late-runs service is a rewrite every ~9.5 min, not
#: every 90 s; its planned start moving is a change only beyond DRIFT of the time until it (at least AHEAD_S
#: / 2); and its reason does not name the job it waits for (that changes with every end ahead of it).  In a
#: 1,000-job bench_queue run the deep queue's rewrites were 1.7 per job with a backlog of ~50 at every tick.
DEEP_AHEAD_S = 600.0
DRIFT = 0.25
ENDER = re.compile(r", after job [0-9a-f-]{36} ends")


def start_moved(planned_s: float, scheduled: datetime | None, now: float, deep: bool) -> bool:
    """Whether a waiting run's planned start (Unix seconds) differs from its
    scheduled time ``scheduled`` (a datetime, or None) enough to rewrite
    it: by AHEAD_S / 2 or more; for a ``deep`` run (its scheduled time at
    least DEEP_AHEAD_S ahead), by DRIFT of the time until its start, and not
    while both stay within DEEP_AHEAD_S (the scheduled time says "not
    before") and the scheduled time is AHEAD_S / 4 or more ahead."""
    if scheduled is None:
        return True
    at = scheduled.timestamp()
    if not deep:
        return abs(at - max(planned_s, now + AHEAD_S)) >= AHEAD_S / 2
    if planned_s <= now + DEEP_AHEAD_S and at >= now + AHEAD_S / 4:
        return at > now + DEEP_AHEAD_S + AHEAD_S / 2  # far later than its planned start: it would look late to start
    return abs(at - max(planned_s, now + DEEP_AHEAD_S)) >= max(AHEAD_S / 2, DRIFT * (planned_s - now))


def planner_reason(message: str | None) -> bool:
    """Whether a waiting run's state message is a reason the planner gave
    (with its planned start), not the submission's or a requeue's."""
    return bool(message) and ("; earliest start " in message or "; estimated start " in message)


def same_but_clocks(old: str | None, new: str) -> bool:
    """Whether a waiting run's reason is the same but for its clock times
    (the planned start moves a little at every tick; the scheduled time
    says it, rewritten when it moves by a minute or more)."""
    return old is not None and _CLOCK.sub("", old) == _CLOCK.sub("", new)
