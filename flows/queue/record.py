"""Record the planner's decisions on the flow runs: place, say why a run
waits (state message, scheduled time, a log line), refuse, crash the runs of
a lost node and requeue crashed runs with retries left."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any

from e31.flows.placement import Placement, RunningJob
from e31.flows.placement.reasons import ender_clause
from e31.flows.queue.mapping import AHEAD_S, DOWN, FENCED, PLACED, QUEUED, PlacementRecord, record_of
from e31.flows.queue.cache import RunCache
from e31.flows.queue.writes import RunLogs, RunWriter
from e31.flows.queue.pace import (DEEP_AHEAD_S, ESTIMATE_EVERY_S, REASON_DEPTH, REASON_EVERY_S, WRITTEN, Written,
                                  start_moved)
from e31.flows.queue.snapshot import Snapshot, retries_used, unstarted_of
from e31.flows.queue.tenancy import tenant_of
from e31.specs import JobSpec
from e31.tasks.supervisor.marks import work_never_started


def humane(reason: str, snap: Snapshot) -> str:
    """``reason`` with each flow run id it names given as ``NAME (ID8)``, and
    a node held for want of a worker said so.  A run with a run handed over
    behind it stands for both, and the reason names the last of them (the
    one whose end frees the resources)."""
    for _ in range(len(snap.behind)):  # along a chain of handed-over runs, to its last
        named = [(b, a) for b, a in snap.behind.items() if f"after job {a} ends" in reason]
        if not named:
            break
        reason = reason.replace(f"after job {named[0][1]} ends", f"after job {named[0][0]} ends")
    for key, spec in snap.specs.items():
        if key in reason:
            reason = reason.replace(key, f"{spec.name} ({key[:8]})")
    for held in snap.running:  # the stand-ins holding a node without a worker, or fenced, by their node
        if held.id == DOWN + held.node:
            reason = reason.replace(ender_clause(held.id), f", once node {held.node}'s e31 worker answers")
        elif held.id == FENCED + held.node:
            reason = reason.replace(ender_clause(held.id), f", once the runs lost on node {held.node} are confirmed "
                                    f"ended (by node {held.node}'s e31 worker, started again there)")
    return reason.replace(DOWN, "no worker on ").replace(FENCED, "fence on ")


def refuse_at_destination(spec: JobSpec, run_id: str, reason: str, tenant: str | None = None) -> None:
    """Write a ``failed`` manifest (no files) saying why the queue refused
    the job at its destination's ``partial/``, as a refused ``e31 run`` would
    not start at all, naming the pool's ``tenant`` it was submitted for: best
    effort (the destination's credentials may live only on the workers)."""
    try:
        from e31.flows.compile import compile_plan
        from e31.tasks.deliver import ReturnTarget, write_failure_manifest
        from e31.tasks.storage.options import register_destination

        plan = compile_plan(spec)
        register_destination(spec, plan)
        write_failure_manifest(ReturnTarget(job=spec.name, run_id=run_id, output_dir=str(plan.output_dir),
                                            output_url=plan.output_url, declared=plan.output_files, gpus=plan.gpus,
                                            cpus=plan.cpus, spec_sha256=plan.spec_sha256,
                                            checkpoint_url=plan.checkpoint_url, tenant=tenant),
                               f"refused by the queue: {reason}")
    except Exception:
        pass


def handover_lead(snap: Snapshot, p: Placement, handover_s: float, taken: set[str]) -> RunningJob | None:
    """The running job whose resources the waiting placement ``p`` takes
    over at its end, when ``p`` may be handed over now: ``p`` is a reserved
    start on that job's node, planned at that job's planned end (within
    1 s; an end already past counts as ``now + 1`` s, the planner's rule),
    which is at most ``handover_s`` seconds away; the job holds its node
    (``Running``; or ``Placed`` or ``Pending``, its flow process not started
    yet: the next run's flow process then starts beside it, rather than
    after a later tick sees it ``Running``, which with short jobs on a busy
    server came too late to hide that start behind its work), is not in
    ``taken`` (already has a run behind it), and holds every GPU
    device ``p`` is planned on, at least its CPUs and its memory (bytes).
    None otherwise (``handover_s`` <= 0 turns handovers off; none on a node
    in ``snap.overbooked``, whose runs' holdings were clipped; none for a job that borrows beyond its
    tenant's quota, ``snap.borrowing``)."""
    if handover_s <= 0 or p.action != "wait" or not p.reserved or p.node is None or p.start is None or \
            p.node in snap.overbooked or p.gang:  # its runs hold more than it has: what each holds is a guess
        return None  # (a gang starts on all its nodes at once: no handover behind one run)
    if p.job in snap.borrowing:  # lent capacity is lent once free: a job within its quota arriving meanwhile gets it
        return None
    memory = snap.specs[p.job].request.memory or 0
    for lead in sorted(snap.running, key=lambda r: r.expected_end):
        run = snap.runs.get(lead.id)
        if lead.node != p.node or run is None or lead.id in taken or not _leads(run.state) or lead.gang:
            continue
        end = max(lead.expected_end, snap.now + 1.0)
        if end - snap.now > handover_s:
            break
        if abs(p.start - end) <= 1.0 and set(p.devices) <= set(lead.devices) and p.cpus <= lead.cpus \
                and memory <= lead.memory:
            return lead
    return None


def _leads(state: Any) -> bool:
    """Whether a run in ``state`` may have a run handed over behind it: it
    holds its node and will run there (``Running``, ``Pending``, or
    ``Scheduled`` named ``Placed``); not ``Cancelling``."""
    kind = state.type.value
    return kind in ("RUNNING", "PENDING") or (kind == "SCHEDULED" and state.name == PLACED)


def _local(snap: Snapshot, p: Placement) -> str:
    """What a placement's message adds when its node holds the job's inputs staged."""
    job = next((q for q in snap.queued if q.id == p.job), None)
    return "; inputs already staged there" if job is not None and p.node in job.preferred_nodes else ""


#: Crashes before its work started (``run_count`` 0: node lost while placed, killed while starting) requeued.
MAX_STARTLESS_CRASHES = 3


def _crashes_before_start(client: Any, key: str) -> int:
    """How many times the run ``key`` entered ``Crashed`` (its state history:
    read only for a crashed run about to be requeued that never started)."""
    return sum(1 for s in client.read_flow_run_states(key) if s.type.value == "CRASHED")


def _placed(run: Any, p: Placement, after: str | None = None) -> PlacementRecord:
    """The placement record of ``p`` (a start, or a handover behind the run ``after``) for the run ``run``:
    its attempt, its counts of attempts that crashed before their work started and of preemptions, and its
    attained service carried over."""
    was = record_of(run)
    return replace(was.kept(), node=p.node, devices=tuple(p.devices), cpus=p.cpus, attempt=was.attempt or 0,
                   after=after, gang=tuple((name, tuple(devices)) for name, devices in p.gang))


def _words(snap: Snapshot, p: Placement, deep: bool) -> tuple[str, str | None]:
    """The key of a waiting placement's words as the scheduler writes them (:class:`Written`): its reason's
    shape and the job it names as the one it waits for (the last of a chain of handed-over runs: what
    :func:`humane` names); a deep run's reason names none."""
    if deep or p.ender is None:
        return (p.shape.replace(ender_clause(p.ender), "") if p.ender else p.shape), None
    behind = {a: b for b, a in snap.behind.items()}  # run -> the run handed over behind it
    ender = p.ender
    for _ in range(len(behind)):
        if ender not in behind:
            break
        ender = behind[ender]
    return p.shape, ender


def _fence(client: Any, snap: Snapshot, key: str, node: str) -> bool:
    """Write the fence of the lost run ``key`` on ``node`` (:func:`e31.tasks.supervisor.fence.fence_value`,
    named per run and node: :func:`~e31.tasks.supervisor.fence.fence_name`); True when it exists now."""
    from prefect.client.schemas.actions import VariableCreate

    from e31.tasks.supervisor.fence import fence_name, fence_value

    name = fence_name(key, node)
    if name in snap.fences:
        return True
    spec = snap.specs.get(key)
    try:
        client.create_variable(VariableCreate(name=name, value=fence_value(
            snap.pool, node, key, spec.name if spec is not None else None, snap.now)))
        return True
    except Exception:  # already there (an earlier tick wrote it), or the API is busy: read it to know
        try:
            return client.read_variable_by_name(name) is not None
        except Exception:
            return False


def apply(client: Any, snap: Snapshot, placements: list[Placement], cache: RunCache | None = None,
          max_waits: int | None = None, max_wait_s: float | None = None, handover_s: float = 0.0,
          preemptions: list[Any] | None = None) -> dict[str, int]:
    """Record the plan on the flow runs: place the runs that start now (their
    node, devices and CPUs in their ``placement`` parameter, state ``Placed``), write each
    waiting run's reason and planned start (only when they changed), fail the
    refused ones with their reason; crash the runs of lost nodes (cancel
    those being cancelled: a cancelled job never runs again) and requeue
    crashed runs with retries left (a run that crashed before its work
    started uses none, and is refused at its ``MAX_STARTLESS_CRASHES + 1``-th
    such crash).  Each write is recorded in ``cache`` (when given).  Starts
    and refusals are written first; ``max_waits`` bounds the waiting runs
    whose reason is rewritten in this call (~25 ms each on an idle server),
    soonest planned start first, and ``max_wait_s`` the seconds spent on
    them (checked before each write after the first: on a busy server one
    write can take 0.5 s): the others are counted ``deferred`` and written
    by the next calls.  With a ``cache`` (the scheduler's ticks), a waiting
    run beyond the :data:`REASON_DEPTH` soonest whose reason was written less
    than :data:`REASON_EVERY_S` seconds ago (:data:`ESTIMATE_EVERY_S` beyond
    the planner's reservations) keeps it (``kept``); such a deep run's
    reason names no job it waits for, its scheduled time is at least
    ``DEEP_AHEAD_S`` ahead, and only a move of its start by ``DRIFT`` of the
    time until it counts (:mod:`e31.flows.queue.pace`).  Returns counts per
    action (``gone``: runs deleted on the server since they were read;
    ``stale``: runs changed since, not written; ``undone``: writes that
    overtook a cancel, undone; see :class:`e31.flows.queue.writes.RunWriter`).  Each write's log
    line goes out in one request at the end.

    ``handover_s``: seconds before a running job's planned end within which
    the next run planned on its resources is handed over
    (:func:`handover_lead`): placed at once like a start, with ``e31_after``
    naming the job ahead in its ``placement``, and counted
    ``handover``; its flow process waits for the job ahead to end before
    its work starts (:mod:`e31.flows.queue.handover`).

    ``preemptions``: the plan's preemptions
    (:func:`e31.flows.queue.preempt.plan`): their victims are stopped
    (``Preempting``, counted ``preempt``) and each job placed behind them
    (counted ``start``); preempted runs that have returned their output
    (``snap.preempted``) are queued again (``requeued``).  A tick that queues
    runs again (a crash, a preemption, a lost node) starts nothing and
    preempts nothing (its starts are counted ``deferred``): the next tick
    plans with those runs."""
    logs = RunLogs(client)
    try:
        return _apply(client, snap, placements, cache, max_waits, max_wait_s, logs, handover_s, preemptions or [])
    finally:
        logs.send()


def _apply(client: Any, snap: Snapshot, placements: list[Placement], cache: RunCache | None, max_waits: int | None,
           max_wait_s: float | None, logs: RunLogs, handover_s: float = 0.0,
           preemptions: list[Any] = ()) -> dict[str, int]:
    from e31.flows.queue import preempt
    from e31.states import cancelled, crashed, placed, queued, refused

    counts = {"start": 0, "handover": 0, "wait": 0, "refuse": 0, "lost": 0, "requeued": 0, "unchanged": 0, "gone": 0,
              "stale": 0, "undone": 0, "deferred": 0, "kept": 0, "preempt": 0, "cancel": 0}
    write = RunWriter(client, cache, counts, snap.pool or None)  # snap.pool: the work pool's name
    now = datetime.fromtimestamp(snap.now, timezone.utc)
    for key in snap.lost:
        run = snap.runs[key]
        node = snap.lost_on.get(key) or record_of(run).node
        if run.state.type.value == "SCHEDULED":  # Placed: its worker had not taken it, so no process of it
            # exists there (Prefect's worker proposes Pending before it starts a flow process): no fence, and it
            # is queued again at once, as a run that crashed before its work started
            message = (f"Queued again: node {node} stopped answering (no worker heartbeat for {snap.lease_s:g} s) "
                       "before its worker took the run; nothing of it ran there, which uses none of its retries")
            requeued = queued(message, now + timedelta(seconds=AHEAD_S))
            kept = record_of(run).kept()
            if write.state(key, requeued) and write.place(key, run, kept, check=False):
                logs.add(key, message)
                counts["requeued"] += 1
            continue
        lost = (f"node {node} stopped answering (no worker heartbeat for {snap.lease_s:g} s); its resources are "
                "free again once its processes there are confirmed ended")
        # still as seen (a run that ended by itself meanwhile is left, and no fence outlives it), then the fence
        # (a run marked lost always has its node fenced), then the crash
        if not write.current(key) or not _fence(client, snap, key, node):
            continue
        # a cancelled run is never requeued; a preempted one is (as a crash: its output may not have come back)
        ending = cancelled(f"cancelled (a cancel was requested); {lost}") \
            if run.state.type.value == "CANCELLING" and not preempt.is_preempting(run.state) else \
            crashed(f"{preempt.PREEMPTED_LOST}{lost}") if preempt.is_preempting(run.state) else crashed(lost)
        if write.state(key, ending, check=False):
            counts["lost"] += 1  # requeued by a later tick, once the crash has settled, when it has retries left
    for key in snap.requeue:
        run = snap.runs[key]
        startless, free = work_never_started(run), unstarted_of(run)
        # a run that ran but crashed before its work started (handed over, lost while it waited) counts itself
        free_now = free + (1 if startless and run.run_count else 0)
        crashes = 0 if not startless else free_now if run.run_count else _crashes_before_start(client, key)
        if crashes > MAX_STARTLESS_CRASHES:
            why = (f"it crashed {crashes} times before its work started (see its logs); submit it again once that "
                   "is fixed")
            if write.state(key, refused(why)):
                # nothing of it ran: its destination says why
                refuse_at_destination(snap.specs[key], key, why, tenant_of(run.tags))
                counts["refuse"] += 1
            continue
        attempt = run.run_count or 1
        message = (f"Queued: retry {retries_used(run)} of {snap.specs[key].request.retries} after a crash (resumes from "
                   "its newest durable checkpoint)") if not startless else \
            "Queued again: it crashed before its work started, which uses none of its retries"
        kept = replace(record_of(run).kept(), attempt=attempt, unstarted=free_now)
        if preempt.preempted_then_lost(run.state):  # a preemption: none of its retries used
            message = ("Queued: preempted, then lost with its node before its output came back; none of its retries "
                       "used (resumes from its newest durable checkpoint)")
            kept = replace(kept, preempted=(*kept.preempted, run.state.timestamp.timestamp()))
        requeued = queued(message, now + timedelta(seconds=AHEAD_S))
        # the state first: a crashed run's job variables cannot be changed
        if write.state(key, requeued) and write.place(key, run, kept, check=False):
            counts["requeued"] += 1
    preempt.requeue(write, snap, logs, counts)
    for key in snap.unplaced_cancels:
        message = "cancelled while it waited in the queue; the work did not run again"
        if write.state(key, cancelled(message)):
            logs.add(key, f"Cancelled: {message}")
            counts["cancel"] += 1
    for key, why in snap.bad.items():
        run = snap.runs[key]
        if run.state.type.value == "SCHEDULED" and run.state.name == QUEUED:
            if write.state(key, refused(why)):
                counts["refuse"] += 1
    for key, why in snap.blocked.items():
        run, message = snap.runs[key], f"Queued: {why}"
        before = WRITTEN.of(run)
        if run.state.name == QUEUED and before is not None and before.words == (message, None):
            counts["unchanged"] += 1
            continue
        if write.state(key, queued(message, now + timedelta(seconds=AHEAD_S))):
            WRITTEN.note(key, Written(getattr(getattr(write.result, "state", None), "id", None), (message, None), None))
            logs.add(key, message)
            counts["wait"] += 1
    # Runs queued again this tick (a crash, a preemption, a lost node) were not in the plan: what it starts now
    # could take what one of them has priority to (a deadline job that crashed would then preempt again).  The
    # next tick plans with them.
    held = counts["requeued"] > 0
    by_preemption = preempt.start(write, snap, [] if held else list(preemptions), placements, logs, counts)
    order = {"start": 0, "refuse": 1}
    waits_from: float | None = None  # when the first waiting run's reason was written
    taken = set(snap.behind.values())  # runs that have a run handed over behind them
    waits_seen = 0  # waiting runs so far, soonest planned start first
    for p in sorted(placements, key=lambda p: (order.get(p.action, 2), p.start or 0.0)):
        if p.job in by_preemption:
            continue
        if held and p.action == "start":
            counts["deferred"] += 1
            continue
        run = snap.runs[p.job]
        lead = handover_lead(snap, p, handover_s, taken)
        if lead is not None:
            if not write.place(p.job, run, _placed(run, p, after=lead.id)):
                continue
            ahead = snap.specs[lead.id].name
            local = _local(snap, p)
            why = (f"handed over behind {ahead} ({lead.id[:8]}) on {p.node}: its flow process starts now and stages "
                   f"the inputs; the work starts once {ahead} has returned its output (planned "
                   f"{datetime.fromtimestamp(p.start, timezone.utc):%H:%M:%S} UTC){local}")
            if not write.state(p.job, placed(why, now), check=False):
                continue
            taken.add(lead.id)
            logs.add(p.job, f"Placed: {why}")
            counts["handover"] += 1
            continue
        if p.action == "start":
            if not write.place(p.job, run, _placed(run, p)):
                continue
            local = _local(snap, p)
            if not write.state(p.job, placed(humane(p.reason, snap) + local, now), check=False):
                continue
            logs.add(p.job, f"Placed: {humane(p.reason, snap)}{local}")
            counts["start"] += 1
        elif p.action == "refuse":
            if not write.state(p.job, refused(humane(p.reason, snap))):
                continue
            refuse_at_destination(snap.specs[p.job], p.job, humane(p.reason, snap), tenant_of(snap.runs[p.job].tags))
            counts["refuse"] += 1
        else:
            waits_seen += 1
            deep = cache is not None and waits_seen > REASON_DEPTH
            reason = p.reason.replace(ender_clause(p.ender), "") if deep and p.ender else p.reason
            note = snap.preempt_notes.get(p.job, "")  # a deadline job at risk: the preemption it waits for
            earlier = preempt.preempted_clause(run.state.message if run.state else None)  # kept while it waits
            message = f"Queued: {humane(reason, snap)}{note}" + (f"; earlier: {earlier}" if earlier else "")
            start_s = p.start or snap.now
            planned = datetime.fromtimestamp(max(start_s, snap.now + (DEEP_AHEAD_S if deep else AHEAD_S)), timezone.utc)
            current = run.state
            same_time = not start_moved(start_s, run.next_scheduled_start_time, snap.now, deep)
            # what this scheduler wrote on the run, while its state is still that write (never the message read
            # back): the words' key and the planned node
            before = WRITTEN.of(run)
            words = _words(snap, p, deep)
            words = (words[0] + note, words[1]) if note else words
            same_words = before is not None and before.words == words
            was_on, now_on = (before.node if before is not None else None), (p.node if p.reserved else None)
            # the node matters to a worker that prefetches (planned_start); deep in the queue, to nobody else
            same_node = was_on == now_on or (deep and snap.prefetching is not None
                                              and not {was_on, now_on} & snap.prefetching)
            # a prefetching node reads the planned node from the run's placement: kept there when it names one
            recorded = record_of(run)
            plan_stale = recorded.planned != now_on and bool({recorded.planned, now_on} & (snap.prefetching or set()))
            if current.name == QUEUED and same_words and same_time and same_node:
                if plan_stale:  # its last write did not reach the placement
                    write.place(p.job, run, replace(recorded, planned=now_on))
                counts["unchanged"] += 1
                continue
            written_s = snap.now - (current.timestamp.timestamp() if current.timestamp else 0.0)
            every_s = REASON_EVERY_S if p.reserved else ESTIMATE_EVERY_S
            ahead_s = run.next_scheduled_start_time.timestamp() - snap.now if run.next_scheduled_start_time else 0.0
            if cache is not None and waits_seen > REASON_DEPTH and current.name == QUEUED and same_node \
                    and before is not None and written_s < every_s and ahead_s >= AHEAD_S / 4:
                counts["kept"] += 1  # deep in the queue: it can wait (and is not near going Late)
                continue
            if (max_waits is not None and counts["wait"] >= max_waits) or (
                    max_wait_s is not None and waits_from is not None and time.monotonic() - waits_from >= max_wait_s):
                counts["deferred"] += 1
                continue
            waits_from = time.monotonic() if waits_from is None else waits_from
            if not write.state(p.job, queued(message, planned)):
                continue
            state_id = getattr(getattr(write.result, "state", None), "id", None)
            WRITTEN.note(p.job, Written(state_id, words, now_on))
            if plan_stale:
                write.place(p.job, run, replace(recorded, planned=now_on), check=False)
            if not same_words:
                logs.add(p.job, message)
            counts["wait"] += 1
    return counts
