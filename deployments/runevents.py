"""Wake the scheduler and the workers when a pool's flow runs change, from
the Prefect server's event stream, instead of at their next poll.

The Prefect server emits an event for each state a flow run enters, named
``prefect.flow-run.<state name>`` (``Completed``, ``Queued``, E31's
``Placed``...), with the run's work pool among its related resources
(``prefect.work-pool.<id>``; Prefect 3.9.1, ``prefect/server/models/events.py``),
and streams the events matching a filter to a websocket subscriber
(``prefect.events.clients.get_events_subscriber``).  The scheduler follows
the run ends and submissions (:data:`SCHEDULER_EVENTS`), the workers the
scheduler's own announcements of placements, which name the node
(:mod:`e31.flows.queue.announce`), and the preemptions (:data:`WORKER_EVENTS`); both still poll at their interval (a
worker asks the server only every :data:`QUIET_POLL_S` while the stream is
up: :class:`PollGate`), so a lost stream (a server restart, a proxy that
drops websockets) costs only latency.  Measured with ``tests/benchmarks/bench_queue.py``: see docs/performance.md.

A ``Queued`` state entered from ``Queued`` is a waiting run's reason or
planned start rewritten (the scheduler's own writes, :func:`own_rewrite`):
it does not wake the scheduler, which would otherwise wake itself with
each write it makes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Awaitable, Callable

#: State names whose events make the scheduler tick at once: a run's end frees its resources, a
#: submission (and each requeue) may start at once, a run late or awaiting a retry is due.
SCHEDULER_EVENTS = ("Completed", "Failed", "Cancelled", "Crashed", "TimedOut", "Queued", "Late", "AwaitingRetry",
                    "Preempted")
#: Events that make a worker poll at once: the scheduler's announcement of a run placed on a node
#: (:data:`e31.flows.queue.announce.PLACED_EVENT`, a full event name); and the state name of the queue's
#: preemption of a run (its worker nudges the run's flow process: :func:`poll_on_placements`).
WORKER_EVENTS = ("e31.flow-run.placed", "Preempting")
#: Seconds between attempts to subscribe again after the stream was lost.
RESUBSCRIBE_S = 5.0
#: Seconds between a worker's polls for runs that ask the server while the event stream is up and no
#: ``Placed`` event came (:class:`PollGate`): each one makes it poll at once, so the poll every
#: ``PREFECT_WORKER_QUERY_SECONDS`` (1 s under ``e31 worker``) is only a safety net then (each poll is
#: a write on the server: 7.4 per job in a 1,000-job bench_queue run with 3 workers).
QUIET_POLL_S = 10.0
#: Seconds before a worker asks again for a run placed on its node that its poll did not get, and how many
#: times at most (:func:`poll_on_placements`): on PostgreSQL each poll locks the runs it reads and skips those
#: another worker's poll holds (``FOR UPDATE SKIP LOCKED``), and every worker polls on the same event.
RECHECK_S = 0.25
RECHECK_TRIES = 8

_log = logging.getLogger("e31.events")


def own_rewrite(event: Any) -> bool:
    """Whether ``event`` (a Prefect ``Event``) is a waiting run's reason
    rewritten: ``prefect.flow-run.Queued`` whose payload's ``initial_state``
    is named ``Queued`` too.  A submission (no initial state), a requeue
    (from ``Crashed``) or a run taken back from a node are not."""
    from e31.flows.queue import QUEUED

    initial = (getattr(event, "payload", None) or {}).get("initial_state") or {}
    return event.event == f"prefect.flow-run.{QUEUED}" and initial.get("name") == QUEUED


async def follow(work_pool: str, states: tuple[str, ...], on_event: Callable[[Any], None],
                 connected: Callable[[bool], None] | None = None) -> None:
    """Call ``on_event(event)`` (a Prefect ``Event``; ``event.event`` is
    its name) for each event of a flow run of the work pool
    named ``work_pool`` entering one of the state names ``states`` (or
    named as an entry of ``states`` that has a dot: a custom event), until
    cancelled.  Subscribes again after :data:`RESUBSCRIBE_S` seconds when the
    stream ends or fails (a missing work pool is looked up again then);
    ``connected(True/False)`` is told each time the stream starts or is lost."""
    from prefect.client.orchestration import get_client
    from prefect.events.clients import get_events_subscriber
    from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

    from e31.tasks.storage.masking import scrub

    names = [s if "." in s else f"prefect.flow-run.{s}" for s in states]  # a state name, or an event's own name
    up = None  # whether the stream was up, the last time it changed (None: never yet)
    while True:
        try:
            async with get_client() as client:
                pool_id = (await client.read_work_pool(work_pool)).id
            related = EventRelatedFilter(id=[f"prefect.work-pool.{pool_id}"])
            async with get_events_subscriber(filter=EventFilter(event=EventNameFilter(name=names), related=related),
                                             reconnection_attempts=2) as events:
                if up is False:
                    _log.warning("the Prefect server's event stream of work pool %s is back", work_pool)
                up = True
                if connected is not None:
                    connected(True)
                async for event in events:
                    on_event(event)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the server is down or has no event stream: the poll goes on meanwhile
            if up is not False:  # said once per loss (a proxy that drops websockets shows here), then quiet
                _log.warning("no event stream from the Prefect server for work pool %s (%s: %s); polling only "
                             "until it is back (changes are seen at the next poll, not at once)", work_pool,
                             type(exc).__name__, scrub(str(exc))[:200])
            up = False
        if connected is not None:
            connected(False)
        await asyncio.sleep(RESUBSCRIBE_S)


class PollGate:
    """Whether a worker's poll for runs asks the server (:meth:`ask`):
    always while the event stream is down (:meth:`connected` False, as at
    start) or after a ``Placed`` event (:meth:`seen`) since the last poll
    that asked; else once per ``quiet_s`` seconds.  A Placed event that
    comes during a poll makes the next one ask."""

    def __init__(self, quiet_s: float = QUIET_POLL_S) -> None:
        self.quiet_s, self.up = quiet_s, False
        self.placed = 0  # Placed events seen
        self.asked = 0  # polls that asked the server
        self._polled = -1  # the count of Placed events the last asking poll came after (-1: none yet)
        self._at = 0.0  # time.monotonic() of the last asking poll

    def seen(self, event: Any = None) -> None:
        """A Placed event came."""
        self.placed += 1

    def connected(self, up: bool) -> None:
        """The event stream started (True) or was lost (False)."""
        self.up = up

    def ask(self) -> bool:
        """Whether this poll asks the server (then counted as the last that did)."""
        import time

        placed, now = self.placed, time.monotonic()
        if self.up and placed == self._polled and now - self._at < self.quiet_s:
            return False
        self._polled, self._at = placed, now
        self.asked += 1
        return True


def event_tags(event: Any) -> list[str]:
    """The tags of the flow run an event (a Prefect ``Event``) is about: its
    related resources of role ``tag`` (``prefect.tag.<tag>``; Prefect 3.9.1,
    ``prefect/server/models/events.py``)."""
    prefix = "prefect.tag."
    return [str(r.id)[len(prefix):] for r in getattr(event, "related", None) or ()
            if getattr(r, "role", None) == "tag" and str(r.id).startswith(prefix)]


def poll_on_placements(work_pool: str, node: str, gate: PollGate, poll: Callable[[], Awaitable[Any]],
                       logger: Any, on_preempting: Callable[[str], None] | None = None,
                       placed_here: Callable[[str], Awaitable[bool]] | None = None,
                       on_member: Callable[[str], None] | None = None) -> list[asyncio.Task]:
    """A worker's two asyncio tasks (to cancel at its teardown) that call
    ``poll()`` (Prefect's ``get_and_submit_flow_runs``) at once when a run of
    the work pool ``work_pool`` is placed on ``node``: the scheduler's
    announcements (:mod:`e31.flows.queue.announce`, :func:`follow`), of
    which those naming another node are left alone (one naming none wakes
    it, to be safe); a ``prefect.flow-run.Placed`` event, were it
    followed, by the tags it carries (:func:`event_tags`, which may be
    older than the placement).  ``gate`` is told of the stream and
    the events.  A poll that fails is logged at debug level: the worker's
    own poll every ``PREFECT_WORKER_QUERY_SECONDS`` goes on (asking the
    server only every :data:`QUIET_POLL_S` while the events come).
    ``on_preempting(flow_run_id)`` is called for each ``Preempting`` event
    (any node's: the callee knows its own flow processes), and
    ``on_member(flow_run_id)`` for each announcement of a multi-node run
    with ``node`` among its other nodes (:data:`~e31.flows.queue.announce.MEMBERS_LABEL`).

    With ``placed_here``, ``poll()`` returns the flow run ids (str) the
    server gave it, before any filter by node: a run an event named that is
    not among them is looked up (``placed_here(flow_run_id)``: still
    waiting to be taken, and placed on this node) and, while it is, asked
    for again every :data:`RECHECK_S` seconds, :data:`RECHECK_TRIES` times
    at most.  A PostgreSQL server skips the runs another worker's
    concurrent poll has locked (another node's placement, or its quiet
    poll): the run's own worker then came away without it and waited for
    its next quiet poll (releases 4-11 s late in ``bench_queue.py
    --database postgresql``)."""
    from e31.flows.queue.announce import MEMBERS_LABEL, NODE_LABEL, PLACED_EVENT
    from e31.flows.queue.mapping import placed_on

    placed, woken = asyncio.Event(), set()

    def on_placed(event: Any) -> None:
        resource = str(getattr(getattr(event, "resource", None), "id", "") or "")
        run_id = resource[len("prefect.flow-run."):] if resource.startswith("prefect.flow-run.") else None
        if event.event.endswith(".Preempting"):
            if on_preempting is not None and run_id:
                on_preempting(run_id)
            return
        named = event.resource.get(NODE_LABEL) if event.event == PLACED_EVENT else placed_on(event_tags(event))
        if event.event == PLACED_EVENT and node in (event.resource.get(MEMBERS_LABEL) or "").split(","):
            if on_member is not None and run_id:
                on_member(run_id)
        if named not in (None, node):
            return  # another node's run
        if run_id:
            woken.add(run_id)
        gate.seen(event)
        placed.set()

    async def poll_when_placed() -> None:
        while True:
            await placed.wait()
            placed.clear()
            wanted = set(woken)
            woken.clear()
            for attempt in range(RECHECK_TRIES + 1):
                try:
                    got = await poll()  # Prefect skips runs it is already submitting
                except Exception as exc:
                    logger.debug("poll after a placement failed: %s: %s", type(exc).__name__, exc)
                    break
                if placed_here is None or attempt == RECHECK_TRIES:
                    break
                missing = wanted - set(got or ())
                wanted = set()
                for run_id in missing:
                    try:
                        if await placed_here(run_id):
                            wanted.add(run_id)
                    except Exception as exc:  # the next quiet poll takes it
                        logger.debug("could not read flow run %s: %s: %s", run_id, type(exc).__name__, exc)
                if not wanted:
                    break
                gate.seen()  # the next poll asks the server
                await asyncio.sleep(RECHECK_S)

    return [asyncio.create_task(follow(work_pool, WORKER_EVENTS, on_placed, gate.connected)),
            asyncio.create_task(poll_when_placed())]


class Wakeup:
    """A daemon thread that follows the work pool's flow-run events of the
    state names ``states`` (:func:`follow`); :meth:`wait` returns as soon as
    one came since the last call, or after ``timeout`` seconds.  Events for
    which ``ignore(event)`` is true do not wake it (counted in ``ignored``).
    ``connected``: whether the stream is up now."""

    def __init__(self, work_pool: str, states: tuple[str, ...] = SCHEDULER_EVENTS,
                 ignore: Callable[[Any], bool] | None = None) -> None:
        self._event, self._closed, self._ignore = threading.Event(), False, ignore
        self._runs: set[str] = set()  # the flow run ids of the events that woke it, until taken
        self._lock = threading.Lock()
        self.connected = False
        self.events = 0  # events received that woke it
        self.ignored = 0
        self._thread = threading.Thread(target=self._run, args=(work_pool, states), name="e31-events", daemon=True)
        self._thread.start()

    def _run(self, work_pool: str, states: tuple[str, ...]) -> None:
        def seen(event: Any) -> None:
            if self._ignore is not None and self._ignore(event):
                self.ignored += 1
                return
            self.events += 1
            resource = str(getattr(getattr(event, "resource", None), "id", "") or "")
            if resource.startswith("prefect.flow-run."):
                with self._lock:
                    self._runs.add(resource[len("prefect.flow-run."):])
            self._event.set()

        def up(value: bool) -> None:
            self.connected = value

        async def main() -> None:
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
            if not self._closed:  # close() may have come before this thread ran
                await follow(work_pool, states, seen, up)

        try:
            asyncio.run(main())
        except asyncio.CancelledError:
            pass

    def close(self) -> None:
        """Stop following (the thread ends soon after)."""
        self._closed = True
        loop, task = getattr(self, "_loop", None), getattr(self, "_task", None)
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop has ended already
                pass

    def take_runs(self) -> set[str]:
        """The flow run ids of the events that woke it since the last call
        (the scheduler reads those its filters did not return by their id:
        a submission committed long after its scheduled time was computed,
        on a busy server, falls outside the filter for new runs)."""
        with self._lock:
            runs, self._runs = self._runs, set()
        return runs

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for an event; True when one came
        (since the last call, or during this one)."""
        came = self._event.wait(timeout)
        self._event.clear()
        return came
