"""The tags a flow process writes on its own flow run, read by the queue: its work started
(:data:`WORK_STARTED`) and ended (:data:`WORK_ENDED`), each checkpoint made durable
(:data:`CHECKPOINT_TAG`), the work a preemption lost (:data:`LOST_TAG`); and their readers.

Each is written only in a flow process an ``e31 worker`` started (``E31_NODE`` set), from a thread, on the
tags the run's reader (:mod:`e31.tasks.supervisor.cancel`) read last, with the attempt (``run_count``).
"""

from __future__ import annotations

import contextvars
import threading
import time
from typing import Callable

from prefect.client.orchestration import get_client

from e31.tasks.supervisor.fence import this_node

#: The tag a flow run gets once its work has ended without a cancel stopping it: ``e31-work-ended:``, the
#: attempt (the run's ``run_count`` then) and the time (ISO 8601 UTC), e.g. ``e31-work-ended:1:2026-12-03T18:41:37Z``.
#: A cancel of that attempt from then on changes nothing, and ``e31 cancel`` says it came too late; a later
#: attempt of the run (requeued after a crash: ``run_count`` grows) is not concerned.
WORK_ENDED = "e31-work-ended:"
#: Seconds the return waits at most for :func:`mark_work_ended`'s write (a slow API does not hold the output back).
MARK_WAIT_S = 5.0


def mark_work_ended(flow_run_id: str | None, at: float | None = None) -> bool:
    """Tag the flow run ``flow_run_id`` :data:`WORK_ENDED` with its attempt
    and the time ``at`` (Unix seconds; now when None), in a flow process an
    ``e31 worker`` started (``E31_NODE`` set: a run of a pool, which ``e31
    cancel`` may reach).  A PATCH of the run's tags alone, as the
    prefetcher's (``e31.deployments.prefetch_runs.tag_staged``), onto the
    tags the run's reader (:class:`_Reader`) read last (one read more
    without one), made in a thread that the caller waits for at most
    :data:`MARK_WAIT_S` seconds.  Returns whether the tag was written by
    then; an API error only loses the words of a late ``e31 cancel`` (the
    run still ends as its manifest says)."""
    if flow_run_id is None or this_node() is None:
        return False
    from datetime import datetime, timezone

    def stamp(t: float) -> str:
        return f":{datetime.fromtimestamp(t, timezone.utc):%Y-%m-%dT%H:%M:%SZ}"

    return _tag_attempt(flow_run_id, WORK_ENDED, at=time.time() if at is None else at, stamp=stamp)


#: The tag a flow process puts on its run at each checkpoint made durable, in a flow process an ``e31 worker``
#: started: ``e31-checkpoint:``, the attempt and the time (Unix seconds), e.g. ``e31-checkpoint:2:1796523661``.
#: The queue reads it as the work a preemption would throw away: the work since then
#: (:func:`e31.flows.placement.preemption.lost_seconds`).
CHECKPOINT_TAG = "e31-checkpoint:"


def mark_checkpoint(flow_run_id: str | None, at: float | None = None) -> None:
    """Tag the flow run ``flow_run_id`` :data:`CHECKPOINT_TAG` with its attempt and the time ``at`` (Unix
    seconds; now when None), in a flow process an ``e31 worker`` started; returns at once (the write runs in
    a thread of its own, and one the API does not take is dropped: the queue then counts the work since the
    attempt's start, or since the checkpoint before, as the loss)."""
    if flow_run_id is None or this_node() is None:
        return
    # read fresh: the tags its reader read last may lack this process's own newer tags (work started)
    _tag_attempt(flow_run_id, CHECKPOINT_TAG, wait_s=0.0, fresh=True, at=time.time() if at is None else at,
                 stamp=lambda t: f":{t:.0f}")


#: The tag a preempted run's flow process puts on its run before it ends: ``e31-lost-s:``, the attempt and the
#: seconds of work the run's preemptions have thrown away so far (its manifest's ``lost_s``), e.g.
#: ``e31-lost-s:2:41.5``: the queue carries it into the run's placement record when it queues it again.
LOST_TAG = "e31-lost-s:"


def mark_lost(flow_run_id: str | None, lost_s: float) -> bool:
    """Tag the flow run ``flow_run_id`` :data:`LOST_TAG` with its attempt and ``lost_s`` (seconds), in a
    flow process an ``e31 worker`` started; waits for the write at most :data:`MARK_WAIT_S` seconds and
    returns whether it was written (a lost write makes the queue estimate the loss itself)."""
    if flow_run_id is None or this_node() is None:
        return False
    return _tag_attempt(flow_run_id, LOST_TAG, f":{lost_s:.3f}", fresh=True)


def _tag_attempt(flow_run_id: str, prefix: str, suffix: str = "", wait_s: float = MARK_WAIT_S,
                 fresh: bool = False, at: float | None = None, stamp: Callable[[float], str] | None = None) -> bool:
    """Tag the flow run ``prefix`` + its attempt (``run_count``) + ``suffix``, replacing an older tag of
    that prefix, from a daemon thread: the other tags as read just before the write, and read back after
    it (:func:`e31.prefect_compat.tags.change_tags`: a node's prefetcher and the scheduler write tags too).
    The attempt is the one its reader read last (<= 10 s ago), else read now (always, when ``fresh``).
    A time ``at`` (this machine's Unix seconds) is written on the server's clock, as ``stamp(at + offset)``
    after ``suffix``: the queue judges every time against the server's (:mod:`e31.prefect_compat.clock`;
    the offset measured from the answers of this write's client), and a node's clock may be off by minutes.
    Waits at most ``wait_s`` seconds; returns whether it was written by then.  A write the API does not
    take is dropped: the manifest is still the job's word."""
    from e31.prefect_compat.clock import measure
    from e31.prefect_compat.tags import change_tags

    from e31.tasks.supervisor.cancel import _READERS

    done = threading.Event()
    reader = _READERS.get(flow_run_id)
    known = reader.last if reader is not None and not fresh else None

    def write() -> None:
        try:
            with get_client(sync_client=True) as client:
                attempt = (known or client.read_flow_run(flow_run_id)).run_count
                tag = f"{prefix}{attempt}{suffix}"
                if at is not None and stamp is not None:
                    tag += stamp(at + (measure(client) or 0.0))
                if change_tags(client, flow_run_id, lambda tags: [*(t for t in tags if not t.startswith(prefix)), tag]):
                    done.set()
        except Exception:
            pass

    threading.Thread(target=contextvars.copy_context().run, args=(write,), name=f"e31-{prefix.strip(':')}",
                     daemon=True).start()
    return done.wait(wait_s) if wait_s > 0 else False


#: The tag a handed-over flow run gets as its work starts, once the job ahead of it has ended:
#: ``e31-work-started:`` and the attempt (the run's ``run_count`` then).  A run handed over behind another
#: (``e31_after`` in its placement) is ``Running`` while it only waits; one lost with its node before this tag
#: (and before :data:`WORK_ENDED`) crashed before its work started, which uses none of its retries.
WORK_STARTED = "e31-work-started:"


def mark_work_started(flow_run_id: str | None) -> bool:
    """Tag the flow run ``flow_run_id`` :data:`WORK_STARTED` with its
    attempt, in a flow process an ``e31 worker`` started (``E31_NODE``
    set), before its work starts; the tags are those its reader read last,
    as :func:`mark_work_ended` writes them.  Waits for the write at most
    :data:`MARK_WAIT_S` seconds; returns whether it was written by then (a
    write lost to an API error lets a crash of this attempt be taken for
    one before its work started: queued again without a retry used, its
    fence still keeping the two attempts apart)."""
    if flow_run_id is None or this_node() is None:
        return False
    return _tag_attempt(flow_run_id, WORK_STARTED)


def work_never_started(run: object) -> bool:
    """Whether the current attempt of ``run`` (a Prefect ``FlowRun``, ended
    ``Crashed``) never started its work: Prefect's ``run_count`` is 0 (it
    never ran), or it was handed over behind another run (``e31_after`` in
    its placement), or placed by preempting others (``e31_preempts``):
    Prefect counts it ``Running`` while it waits and its
    tags hold neither :data:`WORK_STARTED` nor :data:`WORK_ENDED` for this
    attempt."""
    from e31.tasks.supervisor.fence import placement_of

    count = getattr(run, "run_count", None) or 0
    if count == 0:
        return True
    placed = placement_of(run)
    if not placed.get("e31_after") and not placed.get("e31_preempts"):
        return False
    marks = (f"{WORK_STARTED}{count}", f"{WORK_ENDED}{count}:")
    return not any(isinstance(t, str) and (t == marks[0] or t.startswith(marks[1])) for t in run.tags or ())


def work_ended_at(run: object) -> str | None:
    """The time (``YYYY-MM-DDTHH:MM:SSZ``) the tags of ``run`` (a Prefect
    ``FlowRun``) say the work of its current attempt ended
    (:func:`mark_work_ended`), or None (no such tag, or an earlier
    attempt's)."""
    for tag in getattr(run, "tags", None) or ():
        if isinstance(tag, str) and tag.startswith(WORK_ENDED):
            attempt, _, when = tag[len(WORK_ENDED):].partition(":")
            if attempt == str(getattr(run, "run_count", None)) and when:
                return when
    return None
