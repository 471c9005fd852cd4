"""The pool's active flow runs, kept between the scheduler's ticks: a full
read now and then (in the background), and at each tick only what can have
changed.

With 1,000 runs queued, reading every active run of the pool each tick
(``POST /flow_runs/filter``, 200 per page) takes 1-3 s on a 2-core machine,
nearly all of the tick.  Prefect's flow run filter has no "updated since";
what changes a queued run from outside the scheduler is, though, each
visible through a filter that returns few runs:

* a new submission: state name ``Queued`` and an ``expected_start_time``
  (set once, at creation, to its first scheduled time: ``AHEAD_S`` after
  submission) later than the last read's;
* a deployment's scheduled run coming due: type ``SCHEDULED`` with an
  ``expected_start_time`` between the last read and now;
* a worker taking a placed run, a run running, crashing or being cancelled
  while running: the types ``PENDING``, ``RUNNING``, ``CANCELLING`` and
  ``CRASHED`` (few: at most the pool's slots, plus crashed runs);
* a run ending (completed, failed, or cancelled while queued, e.g. from the
  UI): a final type with an ``end_time`` since the last read (Prefect's
  ``SetEndTime`` rule sets it on every entry into a final state, forced or not);
* a node's prefetcher tagging a queued run whose inputs it staged: the
  queued runs tagged ``e31-staged`` (few: a node's scratch budget bounds them;
  not read when no node of the pool file has one).

What the scheduler writes itself it records here as the server answered it
(:meth:`RunCache.note_state`, :meth:`RunCache.note_placement`), and it writes
to a run only after reading it again and finding the state the plan saw
(:func:`e31.flows.queue.apply`): a cancel the filters missed is never
overwritten.  What no
filter shows (a run deleted from the UI, a state forced on a queued run by
hand, a submitter whose clock is off by more than ``margin_s``) is seen at
the next full read, about ``full_every_s`` later; a write to a deleted run
fails and drops it at once (:meth:`RunCache.forget`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

from e31.prefect_compat.clock import server_now
from e31.flows.queue.overheads import Overheads
from e31.flows.queue.mapping import AHEAD_S, QUEUED, STAGED, work_pool_name
from e31.specs.pool import PoolSpec
from e31.states import PREEMPTED

#: The state types of the runs the queue plans with (waiting, holding resources, or crashed: maybe requeued).
ACTIVE = ("SCHEDULED", "PENDING", "RUNNING", "CANCELLING", "CRASHED")
#: Of those, the types whose runs are few (read whole at every tick).
MOVING = ("PENDING", "RUNNING", "CANCELLING", "CRASHED")
#: The final types that take a run out of the queue.
ENDED = ("COMPLETED", "FAILED", "CANCELLED")
#: Runs per page of ``read_flow_runs`` (the API's largest page).
PAGE = 200
#: Seconds a node's worker must stay silent past the lease, seen at the ticks, before its runs are
#: crashed: more than a worker's heartbeat interval (10 s), so that after the API itself stopped
#: answering for a while (every heartbeat then looks old) the workers are heard from first.
LOST_CONFIRM_S = 15.0


def read_all(client: Any, pool: PoolSpec, runs_filter: Any) -> list[Any]:
    """Every flow run of the pool's work pool that ``runs_filter`` (a
    ``FlowRunFilter``, see :func:`flow_run_filter`) matches, read page by page."""
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName

    runs: list[Any] = []
    while True:
        got = client.read_flow_runs(work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(
            any_=[work_pool_name(pool)])), flow_run_filter=runs_filter, limit=PAGE, offset=len(runs))
        runs += got
        if len(got) < PAGE:
            return runs


def state_filter(names: tuple[str, ...]) -> Any:
    """A ``FlowRunFilterState`` matching the state types ``names`` (e.g. ``("RUNNING",)``)."""
    from prefect.client.schemas.filters import FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType

    return FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType(n) for n in names]))


class RunCache:
    """The pool's active flow runs (type in :data:`ACTIVE`), by id, kept up
    to date between full reads (see the module docstring).

    ``full_every_s``: seconds between full reads (they bound how long a
    change no filter shows goes unseen); ``margin_s``: seconds each
    incremental read reaches back before the previous one (clock skew
    between the submitters, workers and this process, and the time a write
    takes to land).  Counters ``full_reads`` and ``incremental_reads`` say
    what the reads were.  Full reads after the first run in a thread,
    beside the ticks."""

    def __init__(self, pool: PoolSpec, full_every_s: float = 60.0, margin_s: float = 10.0) -> None:
        self.pool, self.full_every_s, self.margin_s = pool, full_every_s, margin_s
        self.runs: dict[str, Any] = {}
        self.read_at: float | None = None  # Unix seconds (the server's clock) of the last read's start
        self.full_at = float("-inf")  # monotonic seconds of the last full read's start
        self.full_reads = self.incremental_reads = 0
        self.last_full = False  # whether the last read read every run itself (not in the background)
        self._pending: Future | None = None  # a full read under way in the background
        self.silent_since: dict[str, float] = {}  # node -> time.monotonic() its worker was first seen past the lease
        self.ended_at: dict[str, float] = {}  # run id -> Unix seconds of its end, for runs seen ending (the last 1,000)
        self.heard: set[str] = set()  # runs the server's events named since the last read (:meth:`hear`)
        self.overheads = Overheads()  # start latencies per node, as the runs are seen (e31.flows.queue.overheads)
        self.fences: dict[str, dict] | None = None  # the pool's fences as last read (e31.flows.queue.snapshot)
        self.fences_at = -1  # the full_reads count at that read
        self._executor: ThreadPoolExecutor | None = None
        #: whether a node of the pool prefetches (a ``scratch_budget``): else no run is tagged ``e31-staged``,
        #: and a tick does not ask (one filter read of three; a tag put by a worker whose pool file differs
        #: from this one's is seen at the next full read)
        self.prefetching = any(n.scratch_budget for n in pool.nodes)

    def read(self, client: Any, now: float | None = None, full: bool = False) -> list[Any]:
        """The pool's active runs now.  The first call (or ``full``) reads
        every active run.  Later calls apply the changes since the last read
        to the kept runs; when the last full read is ``full_every_s`` old,
        a new one starts in the background (its own client: with 1,000
        runs queued it takes seconds) and replaces the kept runs at the
        first call after it ends, whose changes then reach back to its start."""
        now = server_now() if now is None else now
        if full or self.read_at is None:
            started = time.monotonic()
            self.runs = {str(r.id): r for r in self._read_every(client)}
            self.read_at, self.full_at = now, started
            self.full_reads += 1
            self.last_full = True
            return list(self.runs.values())
        self.last_full = False
        if self._pending is not None and self._pending.done():
            pending, self._pending = self._pending, None
            try:
                found, read_at, full_at = pending.result()
            except Exception:  # the API was busy: the next call starts another
                pass
            else:
                self.runs = self._merged(found, read_at)
                self.read_at, self.full_at = min(self.read_at, read_at), full_at
                self.full_reads += 1
        elif self._pending is None and time.monotonic() - self.full_at >= self.full_every_s:
            self._executor = self._executor or ThreadPoolExecutor(1, thread_name_prefix="e31-full-read")
            self._pending = self._executor.submit(self._read_in_background, server_now(), time.monotonic())
        self._changes(client, now)
        self.read_at = now
        self.incremental_reads += 1
        return list(self.runs.values())

    def hear(self, runs: set[str]) -> None:
        """Flow run ids the server's events named (a submission, an end):
        the next incremental read also reads, by id, those it neither
        returns nor keeps: on a busy server a submission committed long
        after its scheduled time was computed falls outside the filter for
        new runs (its expected start too early) and would wait for the next
        full read, ~60 s."""
        self.heard |= set(runs)

    def _merged(self, found: list[Any], read_at: float) -> dict[str, Any]:
        """The runs of a full read started at ``read_at`` (Unix seconds),
        each replaced by the kept one where that one's state is newer (the
        scheduler placed or requeued it while the full read ran), and with
        the kept runs whose state is newer than the read's start (margin
        included) that it did not see."""
        runs = {str(r.id): r for r in found}
        for key, kept in self.runs.items():
            mine = kept.state.timestamp.timestamp() if kept.state is not None else None
            if mine is None:
                continue
            theirs = runs.get(key)
            if theirs is None:
                if mine >= read_at - self.margin_s:
                    runs[key] = kept
            elif theirs.state is None or mine > theirs.state.timestamp.timestamp():
                runs[key] = kept
        return runs

    def _read_every(self, client: Any) -> list[Any]:
        return read_active(client, self.pool)

    def _read_in_background(self, read_at: float, full_at: float) -> tuple[list[Any], float, float]:
        from prefect.client.orchestration import get_client

        from e31.prefect_compat.busy import retry_busy_quickly

        with retry_busy_quickly(get_client(sync_client=True)) as client:
            return self._read_every(client), read_at, full_at

    def confirm_lost(self, silent: set[str]) -> set[str]:
        """Of the nodes ``silent`` now (no worker heartbeat within the lease),
        those found silent at every read for :data:`LOST_CONFIRM_S` seconds:
        their runs are lost.  A node heard from again starts over."""
        now = time.monotonic()
        self.silent_since = {n: t for n, t in self.silent_since.items() if n in silent}
        for node in silent:
            self.silent_since.setdefault(node, now)
        return {n for n in silent if now - self.silent_since[n] >= LOST_CONFIRM_S}

    def close(self) -> None:
        """Stop the background full read (if any)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _changes(self, client: Any, now: float) -> None:
        from prefect.client.schemas.filters import (FlowRunFilterEndTime, FlowRunFilterExpectedStartTime,
                                                    FlowRunFilterId, FlowRunFilterStateName, FlowRunFilterTags)

        since = datetime.fromtimestamp(self.read_at - self.margin_s, timezone.utc)
        stamp = datetime.fromtimestamp(now, timezone.utc)
        state = state_filter(("SCHEDULED",))
        state.name = FlowRunFilterStateName(any_=[QUEUED])
        submitted = read_all(client, self.pool, flow_run_filter(
            state=state, expected_start_time=FlowRunFilterExpectedStartTime(after_=since + timedelta(seconds=AHEAD_S))))
        # the runs come due, moving and ended: one read of their union (criteria joined by "or_"), split here by
        # the same criteria each would have been read with alone (three reads before: each read's fixed cost is
        # the server's ~23 ms of CPU; the union is as few runs as its parts)
        union = read_all(client, self.pool, flow_run_filter(
            operator="or_", expected_start_time=FlowRunFilterExpectedStartTime(after_=since, before_=stamp),
            state=state_filter(MOVING), end_time=FlowRunFilterEndTime(after_=since)))
        due = [r for r in union if _type(r) == "SCHEDULED" and r.expected_start_time is not None
               and since <= r.expected_start_time <= stamp]
        moving = [r for r in union if _type(r) in MOVING]
        ended = [r for r in union if _type(r) in ENDED and r.end_time is not None and r.end_time >= since]
        staged = read_all(client, self.pool, flow_run_filter(state=state, tags=FlowRunFilterTags(all_=[STAGED]))) \
            if self.prefetching else []
        seen = {str(r.id) for r in moving}
        left = [key for key, run in self.runs.items()  # left the moving types without ending (a flow retry)
                if run.state is not None and run.state.type.value in MOVING and key not in seen]
        for key in left:
            del self.runs[key]
        known = {str(r.id) for r in submitted + union + staged} | set(self.runs) | set(left)
        unseen = sorted(self.heard - known - {str(r.id) for r in ended})  # named by an event, returned by no filter
        self.heard = set()
        if left or unseen:
            submitted += read_all(client, self.pool, flow_run_filter(id=FlowRunFilterId(any_=left + unseen),
                                                                    state=state_filter(ACTIVE)))
        for run in submitted + due + moving + staged:
            self.runs[str(run.id)] = run
        for run in ended:  # last: a run read above that ended since is gone (a preempted one is taken back)
            if kept(run.state):
                self.runs[str(run.id)] = run
                continue
            self.runs.pop(str(run.id), None)
            if run.end_time is not None:
                self.ended_at[str(run.id)] = run.end_time.timestamp()
        while len(self.ended_at) > 1000:  # oldest first (dicts keep their order)
            del self.ended_at[next(iter(self.ended_at))]

    def note_state(self, run_id: str, result: Any, scheduled_time: datetime | None = None) -> None:
        """Record a state the scheduler set (``result``: the
        ``OrchestrationResult`` of ``set_flow_run_state``): the run's kept
        state becomes the server's answer; a run no longer active leaves."""
        run = self.runs.get(str(run_id))
        state = getattr(result, "state", None)
        if run is None or state is None:
            return
        if not kept(state):
            del self.runs[str(run_id)]
            return
        run.state = state
        if scheduled_time is not None:
            run.next_scheduled_start_time = scheduled_time

    def note_placement(self, run_id: str, parameters: dict[str, Any], tags: list[str] | None = None) -> None:
        """Record the ``parameters`` the scheduler wrote (with the run's
        ``placement``; the API replaces them whole), and its ``tags`` when
        it wrote them too."""
        run = self.runs.get(str(run_id))
        if run is not None:
            run.parameters = dict(parameters)
            if tags is not None:
                run.tags = list(tags)

    def refresh(self, run: Any) -> None:
        """Keep ``run`` as just read (or drop it when it is no longer active)."""
        if kept(run.state):
            self.runs[str(run.id)] = run
        else:
            self.runs.pop(str(run.id), None)

    def forget(self, run_id: str) -> None:
        """Drop a run (deleted on the server: a write to it found nothing)."""
        self.runs.pop(str(run_id), None)


def kept(state: Any) -> bool:
    """Whether a run in ``state`` is one the queue plans with: its type is in :data:`ACTIVE`, or it is a
    preempted run the queue takes back (``Cancelled`` named :data:`e31.states.PREEMPTED`)."""
    return state is not None and (state.type.value in ACTIVE or
                                  (state.type.value == "CANCELLED" and state.name == PREEMPTED))


def read_active(client: Any, pool: PoolSpec) -> list[Any]:
    """Every run of the pool the queue plans with (:func:`kept`): the active types, then the preempted runs
    not yet queued again (a filter on the state name: few, each for one tick)."""
    from prefect.client.schemas.filters import FlowRunFilterState, FlowRunFilterStateName

    found = read_all(client, pool, flow_run_filter(state=state_filter(ACTIVE)))
    taken_back = FlowRunFilterState(name=FlowRunFilterStateName(any_=[PREEMPTED]))
    return found + [r for r in read_all(client, pool, flow_run_filter(state=taken_back)) if kept(r.state)]


def _type(run: Any) -> str | None:
    """The type of a run's state (``"RUNNING"``, ...), or None without one."""
    return run.state.type.value if run.state is not None else None


def flow_run_filter(**fields: Any) -> Any:
    """A ``FlowRunFilter`` of ``fields`` (Prefect is imported when called)."""
    from prefect.client.schemas.filters import FlowRunFilter

    return FlowRunFilter(**fields)
