"""``e31 scheduler``: the planner service of one pool, a loop of idempotent ticks.

Each tick reads the pool's flow runs from the Prefect server (a snapshot:
:func:`e31.flows.queue.read`), plans them (:func:`e31.flows.placement.plan`,
pure) and records the plan on the runs (:func:`e31.flows.queue.apply`):
runs that may start are placed on a node and released to its worker, each
waiting run's state message says why and until when, refused runs fail with
their reason, runs of a node whose worker stopped answering are crashed (and
requeued when they have retries left).  A tick that finds nothing new
changes nothing, so a restarted scheduler simply goes on; run one per pool.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from dataclasses import dataclass, field
from typing import Any, Callable

from e31.deployments import presence
from e31.flows import queue
from e31.flows.queue import preempt
from e31.prefect_compat import clock
from e31.flows.placement import plan
from e31.specs.pool import PoolSpec

#: Seconds between ticks (a tick also follows each change it makes at once).
INTERVAL_S = 2.0
#: Waiting runs whose reason one tick rewrites at most (the rest follow in the next ticks, which come at
#: once): a change that moves the planned start of the whole queue does not hold back the next placement.
MAX_WAITS = 25
#: Seconds one tick spends at most rewriting waiting runs' reasons (after the first): on a busy server a
#: write can take 0.5 s, and 25 of them would hold back for 10 s a placement the next tick could make.
MAX_WAIT_S = 0.5
#: Seconds between reads of the jobs' run-time history (completed runs).
HISTORY_EVERY_S = 60.0
#: The actions of a tick after which the next tick comes at once (more may start or end now); after a
#: tick that only wrote (or deferred) waiting runs' reasons, the next one waits for the interval or an
#: event: with a deep queue there are always reasons to rewrite, and back-to-back ticks reading and
#: writing them loaded the server the running jobs need.
AT_ONCE = ("start", "handover", "refuse", "lost", "requeued", "gone", "stale", "undone", "preempt", "cancel")


def at_once(counts: dict[str, int]) -> bool:
    """Whether the tick after one with these action ``counts`` (see
    :func:`e31.flows.queue.apply`) comes at once: it did one of
    :data:`AT_ONCE`."""
    return any(counts.get(k) for k in AT_ONCE)


@dataclass
class Tick:
    """What one tick saw and did: ``queued``/``running`` counts, ``counts``
    per action (:func:`e31.flows.queue.apply`), ``plan_s`` the planner's
    seconds, ``cycle_s`` the whole tick's, ``read_s`` its read's (``full``:
    every active run was read, not only the changes), the ids of the runs
    holding resources (``holding``), and ``resent``: the requests the tick
    sent again after a busy database's 503 (:mod:`e31.prefect_compat.busy`)."""

    queued: int
    running: int
    counts: dict[str, int]
    plan_s: float
    cycle_s: float
    holding: frozenset = frozenset()
    read_s: float = 0.0
    full: bool = True
    resent: int = 0
    #: Node -> what its runs hold beyond what it has (:attr:`e31.flows.queue.Snapshot.overbooked`).
    overbooked: dict = field(default_factory=dict)


@dataclass
class History:
    """What the pool's recent completed runs tell: ``runtimes`` (job name ->
    run times in seconds, oldest first) and ``staged`` (a job's inputs, as
    :func:`e31.flows.queue.inputs_key` -> the nodes that staged them, in the
    run or by prefetch, most recent first: those nodes' scratch folders hold
    them, unless evicted since)."""

    runtimes: dict[str, list[float]]
    staged: dict[tuple[str, ...], list[str]]
    #: Job name -> the median seconds from its work's end to its run's end (its output's return), over its
    #: recent completed runs (e31.flows.queue.overheads).
    returns: dict[str, float] = field(default_factory=dict)
    #: Each tenant's decayed usage by ended runs and when it was read (:mod:`e31.flows.queue.usage`); None
    #: for a pool without tenants.
    usage: Any = None


def history(client: Any, pool: PoolSpec, limit: int = 200) -> History:
    """Read the pool's most recent completed flow runs (see :class:`History`)."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    runs = client.read_flow_runs(
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[queue.work_pool_name(pool)])),
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
            type=FlowRunFilterStateType(any_=[StateType.COMPLETED]))),
        sort=FlowRunSort.START_TIME_DESC, limit=limit)
    from e31.flows.queue.overheads import Overheads, return_seconds
    from e31.tasks.supervisor.marks import WORK_ENDED

    found, returns = History({}, {}), Overheads()
    for run in reversed(runs):  # oldest first
        spec = (run.parameters or {}).get("spec") or {}
        if not isinstance(spec, dict):
            continue
        if run.total_run_time:
            found.runtimes.setdefault(str(spec.get("name")), []).append(run.total_run_time.total_seconds())
        back = return_seconds(run.tags, run.run_count, run.end_time, WORK_ENDED)
        if back is not None:
            returns.returned(str(spec.get("name")), back)
        node, key = queue.placement_of(run).get(queue.NODE_VAR), queue.inputs_key(spec)
        prefetched, _ = queue.staged_tags(run.tags)  # nodes whose prefetcher staged them too (where it did not run)
        for held in (*prefetched, node):  # the node it ran on last: most recent first
            if held and key:
                nodes = found.staged.setdefault(key, [])
                if held in nodes:
                    nodes.remove(held)
                nodes.insert(0, held)
    found.returns = {name: returns.output_s(name) for name in returns.returns}
    if pool.tenants:
        from e31.flows.queue.usage import read_usage

        found.usage = read_usage(client, pool, clock.server_now())
    return found


def snapshot(client: Any, pool: PoolSpec, past: History | None = None, now: float | None = None,
             lease_s: float = queue.LEASE_S, cache: queue.RunCache | None = None) -> queue.Snapshot:
    """The pool's runs as planner input, with run-time history and data
    locality (``past``: read now when not given; ``cache``: the runs kept
    between ticks, else all are read)."""
    past = past or history(client, pool)
    snap = queue.read(client, pool, now=now, history=past.runtimes, staged=past.staged, lease_s=lease_s, cache=cache,
                      returns=past.returns)
    if past.usage is not None:  # the pool's tenants: their usage so far, running jobs' included
        from e31.flows.queue.usage import with_running

        snap.tenancy = with_running(pool, past.usage, [r for r in snap.running if r.id in snap.runs], snap.now)
    return snap


def tick(client: Any, pool: PoolSpec, policy: str = "e31", past: History | None = None,
         now: float | None = None, lease_s: float = queue.LEASE_S, cache: queue.RunCache | None = None,
         max_waits: int | None = None, max_wait_s: float | None = None,
         handover_s: float = queue.HANDOVER_S) -> Tick:
    """Read, plan, apply once (see the module docstring).  ``cache``: the
    pool's runs kept between ticks (:class:`e31.flows.queue.RunCache`; a
    tick then reads only what changed), else every active run is read;
    ``max_waits``, ``max_wait_s``, ``handover_s`` (seconds; 0: no
    handovers): see :func:`e31.flows.queue.apply`."""
    from e31.prefect_compat.busy import busy_retries

    started, resent = time.monotonic(), busy_retries(client)[0]
    snap = snapshot(client, pool, past, now, lease_s, cache)
    t0 = time.monotonic()
    placements = plan(snap.nodes, snap.running, snap.queued, snap.now, policy, tenancy=snap.tenancy)
    if snap.tenancy is not None:
        from e31.flows.queue.tenancy import borrowing_ids

        snap.borrowing = borrowing_ids(snap, placements)
    preemptions = preempt.plan(snap, placements, preempt.rules_of(pool)) if policy == "e31" else []
    plan_s = time.monotonic() - t0
    counts = queue.apply(client, snap, placements, cache, max_waits, max_wait_s, handover_s, preemptions)
    running = sum(1 for r in snap.running if r.id in snap.runs)  # not a node held for want of a live worker
    return Tick(len(snap.queued), running, counts, plan_s, time.monotonic() - started,
                frozenset(r.id for r in snap.running), t0 - started, cache is None or cache.last_full,
                busy_retries(client)[0] - resent, dict(snap.overbooked))


def _failure(exc: BaseException) -> str:
    """What a failed tick says of its cause, ``KIND: text``: ``DatabaseUnavailable`` naming the server's
    setting when the Prefect server answers but its database does not, ``ServerUnanswering`` when it does
    not answer within ``E31_API_TIMEOUT_S`` (its readiness check, asked after an HTTP 5xx or a timeout:
    :func:`e31.prefect_compat.api.ready_problem`), else the error's type and its first 300 characters, any
    secret in them masked."""
    from prefect.settings import PREFECT_API_URL

    from e31.prefect_compat.api import DATABASE_DOWN, ready_problem
    from e31.specs import mask_url
    from e31.tasks import settings
    from e31.tasks.storage import scrub

    api = PREFECT_API_URL.value()
    status = getattr(getattr(exc, "response", None), "status_code", None) or 0
    if api and (status >= 500 or "Timeout" in type(exc).__name__):
        problem = ready_problem(api, settings.value("E31_API_TIMEOUT_S"))
        if problem is not None:
            kind = "DatabaseUnavailable" if problem == DATABASE_DOWN.format(api=mask_url(api)) else "ServerUnanswering"
            return f"{kind}: {problem}"
    return f"{type(exc).__name__}: {scrub(str(exc))[:300]}"


def serve(pool: PoolSpec, policy: str = "e31", interval_s: float = INTERVAL_S, once: bool = False,
          report: Callable[[Tick], None] | None = None, lease_s: float = queue.LEASE_S,
          handover_s: float = queue.HANDOVER_S) -> None:
    """Run ticks until interrupted (``once``: a single tick).  Creates the
    pool's work pool and queue deployment first.  ``report`` is called with
    every tick that changed something.  ``lease_s``: seconds without a
    worker heartbeat after which a node's runs count as lost;
    ``handover_s``: see :data:`e31.flows.queue.mapping.HANDOVER_S`.  Between
    ticks that change nothing, or only rewrite waiting runs' reasons, it
    waits ``interval_s`` seconds, or less: a flow run of the pool ending or
    being submitted wakes it at once (:class:`e31.deployments.runevents.Wakeup`,
    the server's event stream; not the ``Queued`` events of its own
    rewrites, :func:`e31.deployments.runevents.own_rewrite`).  A tick that
    waits on the server longer than ``E31_API_TIMEOUT_S`` is said while it
    waits (:class:`e31.deployments.tickwatch.TickWatch`)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from e31.deployments.runevents import SCHEDULER_EVENTS, Wakeup, own_rewrite
    from e31.deployments.worker import E31Worker
    from e31.deployments.tickwatch import TickWatch
    from e31.prefect_compat.busy import retry_busy_quickly
    from e31.tasks import settings

    with retry_busy_quickly(get_client(sync_client=True)) as client:
        clock.measure(client)  # every server timestamp is judged on the server's clock (e31.prefect_compat.clock)
        queue.ensure_pool(client, pool, E31Worker.get_default_base_job_template())
        me = presence.new_identity()
        presence.claim_pool(client, pool.name, me, lease_s, standby=not once)  # one scheduler per pool
        news, say = clock.SkewNews(), (lambda line: print(f"e31 scheduler: {line}", flush=True))
        if (line := news.news()) is not None:
            say(line)
        # the pool's claim is renewed by a thread of its own: a long tick does not hold the beat back
        beats = None if once else presence.scheduler_beats(pool.name, me, lease_s, say, news).start()
        past, read_at, holding, cache = None, 0.0, frozenset(), queue.RunCache(pool)
        overbooked: dict = {}
        failing: tuple[str, str, int] | None = None  # a failing tick's kind of cause, since when, how many in a row
        wake = None if once else Wakeup(queue.work_pool_name(pool), SCHEDULER_EVENTS, ignore=own_rewrite)
        watch = None if once else TickWatch(PREFECT_API_URL.value() or "", settings.value("E31_API_TIMEOUT_S"),
                                            say, now=clock.server_now).start()  # a tick held by a frozen server
        try:
            while True:
                # every call to the server inside: a server whose database is away for a minute fails the history
                # read or the claim as it fails a tick, and the scheduler carries on once it is back
                if watch is not None:
                    watch.begin()
                try:
                    if beats is not None and beats.lost.is_set():  # another one serves the pool now: its standby
                        presence.claim_pool(client, pool.name, me, lease_s)
                        beats = presence.scheduler_beats(pool.name, me, lease_s, say, news).start()
                        cache.close()
                        cache = queue.RunCache(pool)  # what changed while it waited: read all again
                    if time.monotonic() - read_at > HISTORY_EVERY_S:
                        past, read_at = history(client, pool), time.monotonic()
                    if wake is not None:
                        cache.hear(wake.take_runs())
                    result = tick(client, pool, policy, past, lease_s=lease_s, cache=cache, max_waits=MAX_WAITS,
                                  max_wait_s=MAX_WAIT_S, handover_s=handover_s)
                except Exception as exc:  # the API is busy or a run changed under us: the next tick reads all again
                    if once:
                        raise
                    if watch is not None:
                        watch.end()
                    cache.close()
                    cache = queue.RunCache(pool)
                    stamp = datetime.fromtimestamp(clock.server_now(), timezone.utc)  # the server's clock
                    cause = _failure(exc)
                    kind = cause.split(":", 1)[0]
                    if failing is not None and failing[0] == kind:  # the same kind again: counted, not repeated
                        failing = (kind, failing[1], failing[2] + 1)
                        cause = f"{kind}, again: {failing[2]} in a row since {failing[1]}"
                    else:
                        failing = (kind, f"{stamp:%H:%M:%S}", 1)
                    print(f"{stamp:%H:%M:%S} e31 scheduler: tick failed ({cause}); next tick in {interval_s:g} s",
                          flush=True)
                    time.sleep(interval_s)
                    continue
                if watch is not None:
                    watch.end()
                if failing is not None:
                    print(f"e31 scheduler: ticks go through again, after {failing[2]} failed since {failing[1]}",
                          flush=True)
                    failing = None
                if holding - result.holding:
                    read_at = 0.0  # a run ended: its run time and the node holding its inputs count from the next tick
                holding = result.holding
                changed = sum(v for k, v in result.counts.items() if k not in ("unchanged", "kept"))
                if report is not None and (changed or result.overbooked != overbooked):
                    report(result)
                overbooked = result.overbooked
                if once:
                    return
                if not at_once(result.counts):
                    wake.wait(interval_s)
        finally:
            if beats is not None:
                beats.stop()
            if watch is not None:
                watch.stop()
            cache.close()
            if wake is not None:
                wake.close()
            if not presence.release_pool(client, pool.name, me):
                print(f"e31 scheduler: the Prefect API did not answer within {presence.RELEASE_WAIT_S:g} s as it "
                      f"stopped: its claim on pool {pool.name} ends by itself {presence.STALE_S:g} s after its last "
                      "beat", flush=True)
