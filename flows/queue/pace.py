"""How often the scheduler rewrites a waiting run's reason and scheduled
time: the soonest few exact, the rest told less and less often.

With a deep queue every job's end moves the plan (start, node, the job
waited for) of every waiting run, and each rewrite is a state write, two
reads and an event on the Prefect server the running jobs need.  The rules
here decide which moves are worth a write; :func:`e31.flows.queue.record.apply`
applies them.  Times are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from e31.flows.queue.mapping import AHEAD_S


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


@dataclass(frozen=True)
class Written:
    """What the scheduler wrote on a waiting run, kept by it instead of read
    back from the state message: the ``state_id`` the server gave the
    ``Queued`` state written, the ``words`` of its reason as a key (the
    reason's shape, its clock times left out, and the job it names as the one
    it waits for: two reasons with one key differ only in their times) and
    the ``node`` its reserved start was planned on (None: an estimate)."""

    state_id: Any
    words: tuple[str, str | None]
    node: str | None


class WrittenWaits:
    """The waits this process wrote, by flow run id (:class:`Written`).  An
    entry holds only while the run's state is the very state written (its
    id, which the server draws at random): a state set since by anyone (a
    requeue, a cancel, another scheduler, a person) makes it unknown, and the
    run's reason is written again at the next plan.  A process that starts
    knows none (its first ticks write each waiting run's reason once).  At
    most ``size`` entries, the oldest written dropped first."""

    def __init__(self, size: int = 100_000) -> None:
        self.size, self._by_run = size, {}

    def of(self, run: Any) -> Written | None:
        """What was written on ``run`` (a Prefect ``FlowRun``) while its
        state is still that write; else None."""
        written = self._by_run.get(str(run.id))
        state = getattr(run, "state", None)
        return written if written is not None and state is not None and written.state_id == state.id else None

    def note(self, run_id: str, written: Written) -> None:
        """Keep ``written`` as what was last written on the run ``run_id``."""
        self._by_run.pop(str(run_id), None)
        self._by_run[str(run_id)] = written
        while len(self._by_run) > self.size:
            del self._by_run[next(iter(self._by_run))]

    def planned(self, run: Any) -> tuple[bool, str | None]:
        """Whether the node the waiting ``run``'s reserved start was planned
        on is known here (its state is a write of this process), and that
        node (None: an estimate)."""
        written = self.of(run)
        return (False, None) if written is None else (True, written.node)


#: The scheduler's record of the waits it wrote (one per process: entries are valid only for the state they name).
WRITTEN = WrittenWaits()
