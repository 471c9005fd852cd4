"""What a job's time on a node adds to its run time, measured on the live queue.

A job holds its node from its placement until its output is back, not only
while its work runs.  The planner counts two measured overheads in a queued
job's occupancy (:attr:`e31.flows.placement.QueuedJob.start_s` and
``output_s``), so a job planned into a gap before a reservation leaves the
node in time:

* **start** (per node): from the ``Placed`` state the scheduler writes to the
  flow run's ``Running`` (the worker's poll, the flow process's start), both
  server timestamps, as the scheduler's run cache sees them;
* **return** (per job name): from the end of a completed run's work (its
  ``e31-work-ended`` tag, :data:`e31.tasks.supervisor.marks.WORK_ENDED`) to
  the flow run's end (the output's upload and manifest, the final state).

Each is the median of the last :data:`KEEP` measurements (a running median:
one slow start does not move it), 0 until something was measured.  Values
outside ``[0, MAX_S]`` are dropped (a run held back for hours is no
measurement of a start).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from datetime import datetime
from typing import Any

__all__ = ["KEEP", "MAX_S", "Overheads", "return_seconds"]

#: How many recent measurements each running median keeps.
KEEP = 20
#: Longest start or return counted (seconds); longer ones are not measurements of the overhead.
MAX_S = 3600.0


class Overheads:
    """Running medians of the start latency per node and the return time per job name (seconds)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self.placed_at: dict[str, tuple[float, str]] = {}  # run id -> (Placed state time, node)
        self.starts: dict[str, deque[float]] = {}
        self.returns: dict[str, deque[float]] = {}

    def _add(self, table: dict[str, deque[float]], key: str, seconds: float) -> None:
        if 0.0 <= seconds <= MAX_S:
            table.setdefault(key, deque(maxlen=self.keep)).append(seconds)

    def saw(self, run_id: str, state_name: str | None, state_type: str | None, timestamp: float | None,
            node: str | None) -> None:
        """Note one sighting of a flow run: its state's name and type (``SCHEDULED``, ``RUNNING``, ...),
        the state's server timestamp (Unix seconds) and the node of its placement.  A ``Placed``
        sighting followed by a ``Running`` one adds a start latency for the node."""
        if timestamp is None:
            return
        if state_type == "SCHEDULED" and state_name == "Placed" and node:
            self.placed_at[run_id] = (timestamp, node)
            return
        if state_type == "SCHEDULED":
            self.placed_at.pop(run_id, None)  # queued again: the placement seen is void
            return
        if state_type == "RUNNING" and run_id in self.placed_at:
            placed, where = self.placed_at.pop(run_id)
            self._add(self.starts, where, timestamp - placed)
        elif state_type not in ("PENDING", "RUNNING"):
            self.placed_at.pop(run_id, None)
        while len(self.placed_at) > 10_000:  # runs placed and never seen running: oldest first
            del self.placed_at[next(iter(self.placed_at))]

    def returned(self, job: str, seconds: float) -> None:
        """Note that a completed run of ``job`` took ``seconds`` from its work's end to its end."""
        self._add(self.returns, job, seconds)

    def start_s(self, node: str | None) -> float:
        """The median start latency of ``node`` (0.0 when none was measured)."""
        kept = self.starts.get(node or "")
        return float(statistics.median(kept)) if kept else 0.0

    def start_s_most(self) -> float:
        """The largest of the nodes' median start latencies (0.0 when none was measured): a queued
        job is not yet on a node, and its occupancy must hold wherever it goes."""
        return max((self.start_s(node) for node in self.starts), default=0.0)

    def output_s(self, job: str) -> float:
        """The median return time of ``job``'s completed runs (0.0 when none was measured)."""
        kept = self.returns.get(job)
        return float(statistics.median(kept)) if kept else 0.0


def return_seconds(tags: Iterable[str] | None, run_count: int | None, end_time: datetime | None,
                   prefix: str) -> float | None:
    """Seconds from a completed run's work end to its end: ``end_time`` less the time of its
    work-ended tag (``prefix`` + ``ATTEMPT:ISO-TIME``) for the attempt ``run_count``; None when the
    run has no such tag or no end time."""
    if end_time is None:
        return None
    for tag in tags or ():
        if not (isinstance(tag, str) and tag.startswith(prefix)):
            continue
        attempt, _, when = tag[len(prefix):].partition(":")
        if run_count is not None and attempt != str(run_count):
            continue
        try:
            ended = datetime.fromisoformat(when.replace("Z", "+00:00"))
        except ValueError:
            continue
        if ended.tzinfo is None:
            continue
        return (end_time - ended).total_seconds()
    return None


def from_run(run: Any) -> tuple[str | None, str | None, float | None]:
    """(state name, state type, state timestamp in Unix seconds) of a Prefect flow run."""
    state = getattr(run, "state", None)
    if state is None:
        return None, None, None
    kind = getattr(state.type, "value", None)
    stamp = state.timestamp.timestamp() if getattr(state, "timestamp", None) is not None else None
    return state.name, kind, stamp
