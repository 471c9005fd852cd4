"""The live queue's preemptions: the planner's choice (:func:`e31.flows.placement.preemption.plan_preemptions`,
pure) carried out on the flow runs.

A preemption is a stop like any other, with the queue taking the run back afterwards:

1. The tick writes ``Cancelling`` named ``Preempting`` (:func:`e31.states.preempting`) on each victim,
   with the queue's words (who preempts it, why, when), and places the job that gets the room at once,
   its placement naming the victims (``e31_preempts``, :class:`e31.tasks.placement_record.PlacementRecord`).
   Its flow process starts and stages its inputs, then its work waits for every victim to return its
   output (:mod:`e31.flows.queue.handover`): works never overlap on a device.  Until a victim has ended,
   the placed job holds only what the victims do not (:func:`hold_behind_victims`): nothing is counted
   twice, and no third job is given what either holds.
2. Prefect's worker follows only ``prefect.flow-run.Cancelling`` events (Prefect 3.9.1,
   ``prefect/workers/base.py``); a ``Preempting`` state's event is ``prefect.flow-run.Preempting``, which
   the victim's ``e31 worker`` follows to send its flow process SIGTERM at once.  The flow process reads
   its run's state, sees ``Preempting``, and stops as for a cancel: the stop warning, the grace, its
   newest checkpoint committed, its output returned marked ``partial`` with reason ``preempted``; it
   then ends ``Cancelled`` named ``Preempted`` (:func:`e31.states.preempted`).
3. The next tick queues it again (:func:`requeue`): ``Queued``, the same flow run, its attempt not
   counted against ``request.retries`` (the preemption's time is kept in its placement record, for the
   pool's ``max_per_day`` and for its retries' count), its attained service added up; placed again, it
   resumes from that checkpoint.

Which running runs may be victims (:func:`victim_fields`): those whose spec is preemptible
(:func:`e31.specs.preemption.is_preemptible`) and that are ``Running`` with their work under way: not
a run whose work has ended (its output is on its way back), not one still waiting for the run ahead
of it or for its own victims, not one with a run handed over behind it (that run would start its work
beside the preempting one), not one on a node whose runs hold more than it has.
"""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any

from e31.flows.placement import Placement
from e31.flows.placement.attained import width
from e31.flows.placement.preemption import (PlannedPreemption, PreemptionRules, deadline_at_risk,
                                            deferred_preemptions, plan_preemptions)
from e31.flows.queue.mapping import AHEAD_S, PlacementRecord, record_of
from e31.flows.queue.tenancy import tenant_of
from e31.specs import JobSpec
from e31.specs.pool import PoolSpec
from e31.specs.preemption import is_preemptible
from e31.states import PREEMPTED, PREEMPTING
from e31.tasks.supervisor.marks import CHECKPOINT_TAG

__all__ = ["CHECKPOINT_TAG", "checkpoint_at", "hold_behind_victims", "is_preempted", "is_preempting", "lost_so_far", "plan", "queued_fields", "requeue", "rules_of", "start", "victim_fields", "waiting"]



def rules_of(pool: PoolSpec) -> PreemptionRules:
    """The pool's ``preemption:`` options as the planner's rules."""
    return PreemptionRules(pool.preemption.min_run.total_seconds(), pool.preemption.max_per_day,
                               attained_min_run_s=pool.preemption.attained_min_run.total_seconds())


def is_preempted(run: Any) -> bool:
    """Whether ``run`` (a Prefect ``FlowRun``) is a preempted run that the queue takes back: ``Cancelled``
    named :data:`e31.states.PREEMPTED`."""
    state = getattr(run, "state", None)
    return state is not None and state.type.value == "CANCELLED" and state.name == PREEMPTED


def checkpoint_at(run: Any) -> float | None:
    """When the current attempt of ``run`` made its newest checkpoint durable, as its tags say
    (:data:`e31.tasks.supervisor.marks.CHECKPOINT_TAG`; Unix seconds), or None (none yet, or an earlier attempt's)."""
    prefix = f"{CHECKPOINT_TAG}{getattr(run, 'run_count', None)}:"
    for tag in getattr(run, "tags", None) or ():
        if isinstance(tag, str) and tag.startswith(prefix):
            try:
                return float(tag[len(prefix):])
            except ValueError:
                return None
    return None


def lost_so_far(run: Any) -> float | None:
    """The seconds of work the preemptions of ``run`` threw away so far, as its current attempt's flow
    process tagged it (:data:`e31.tasks.supervisor.marks.LOST_TAG`: its manifest's ``lost_s``), or None."""
    from e31.tasks.supervisor.marks import LOST_TAG

    prefix = f"{LOST_TAG}{getattr(run, 'run_count', None)}:"
    for tag in getattr(run, "tags", None) or ():
        if isinstance(tag, str) and tag.startswith(prefix):
            try:
                return max(0.0, float(tag[len(prefix):]))
            except ValueError:
                return None
    return None


def waiting(run: Any) -> bool:
    """Whether the work of ``run``'s current attempt waits for runs ahead of it (it was handed over behind
    one, or placed by preempting some) and has not started: no ``e31-work-started`` tag of this attempt."""
    from e31.tasks.supervisor.marks import WORK_STARTED

    if not record_of(run).waits_for():
        return False
    return f"{WORK_STARTED}{getattr(run, 'run_count', None)}" not in (getattr(run, "tags", None) or ())


def victim_fields(spec: JobSpec, run: Any, waiting: bool) -> dict[str, Any]:
    """The :class:`e31.flows.placement.RunningJob` fields of preemption for the holding run ``run``:
    ``preemptible`` (see the module docstring; ``waiting``: its work waits for a run ahead or for its
    own victims), ``checkpoint_at``, ``preemptions``, ``attained_s``, ``no_duration``."""
    from e31.tasks.supervisor.marks import work_ended_at

    record = record_of(run)
    state = run.state
    running = state is not None and state.type.value == "RUNNING"
    return {"preemptible": is_preemptible(spec) and running and not waiting and work_ended_at(run) is None,
            "checkpoint_at": checkpoint_at(run), "preemptions": record.preempted, "attained_s": record.attained_s,
            "tenant": tenant_of(getattr(run, "tags", None)),
            "no_duration": spec.request.duration is None}


def queued_fields(spec: JobSpec, run: Any) -> dict[str, Any]:
    """The :class:`e31.flows.placement.QueuedJob` fields of preemption for the waiting run ``run``:
    ``preemptible``, ``attained_s`` and ``waiting_since`` (its last preemption)."""
    record = record_of(run)
    return {"preemptible": is_preemptible(spec), "attained_s": record.attained_s,
            "waiting_since": record.preempted[-1] if record.preempted else None,
            "tenant": tenant_of(getattr(run, "tags", None))}


def hold_behind_victims(snap: Any) -> None:
    """A run placed by a preemption whose victims still hold resources on its node holds only what they do
    not: its devices less theirs, its CPUs and memory less theirs (floored at 0), so the node is counted
    once, as its runs really hold it; it is no victim itself meanwhile.  Once they have ended (the next
    snapshot), it holds its whole placement."""
    holders = {r.id: r for r in snap.running}
    for i, job in enumerate(snap.running):
        victims = [holders[v] for v in record_of(snap.runs[job.id]).victims
                   if v in holders and holders[v].node == job.node] if job.id in snap.runs else []
        if not victims:
            continue
        theirs = {d for v in victims for d in v.devices}
        snap.running[i] = replace(job, devices=tuple(d for d in job.devices if d not in theirs),
                                  cpus=max(0, job.cpus - sum(v.cpus for v in victims)),
                                  memory=max(0, job.memory - sum(v.memory for v in victims)), preemptible=False)


def plan(snap: Any, placements: list[Placement], rules: PreemptionRules) -> list[PlannedPreemption]:
    """The preemptions the plan ``placements`` calls for (:func:`plan_preemptions`) among the snapshot's
    runs; none when no running run may be a victim.  A run on a node whose runs hold more than it has
    (:attr:`e31.flows.queue.Snapshot.overbooked`) or with a run handed over behind it is never one."""
    taken = set(snap.behind.values())
    running = [r if r.preemptible and r.id not in taken and r.node not in snap.overbooked
               else replace(r, preemptible=False) for r in snap.running]
    if not any(r.preemptible for r in running):
        return []
    planned = plan_preemptions(snap.nodes, running, snap.queued, placements, snap.now, rules,
                               getattr(snap, "tenancy", None))
    tenancy = getattr(snap, "tenancy", None)
    snap.preempt_notes = _deferred_words(snap, deferred_preemptions(snap.nodes, running, snap.queued, placements,
                                                                    planned, snap.now, rules, tenancy), rules)
    return planned


def _deferred_words(snap: Any, deferred: dict[str, Any], rules: PreemptionRules) -> dict[str, str]:
    """What a deadline job at risk's waiting reason adds about the preemption it waits for
    (:func:`deferred_preemptions`): ``; preempts NAME (ID) at 03:10:05 UTC, once it has run the pool's
    min_run (10m)``, or why none comes."""
    from e31.specs.units import format_duration

    words = {}
    for key, what in deferred.items():
        if isinstance(what, str):
            words[key] = f"; {what}"
            continue
        at, chosen = what
        names = ", ".join(f"{snap.specs[v].name} ({v[:8]})" if v in snap.specs else v[:8] for v in chosen.victims)
        min_run = format_duration(timedelta(seconds=rules.min_run_s))
        lenders = sorted({r.tenant for r in snap.running if r.id in chosen.victims})
        mine = next((q.tenant for q in snap.queued if q.id == key), None)
        if getattr(snap, "tenancy", None) is not None and lenders and mine not in lenders:
            words[key] = (f"; takes back what tenant{'s' if len(lenders) > 1 else ''} {', '.join(lenders)} borrowed: "
                          f"preempts {names} at {datetime.fromtimestamp(at, timezone.utc):%H:%M:%S} UTC, once "
                          f"{'they have' if len(chosen.victims) > 1 else 'it has'} run the pool's min_run ({min_run})")
            continue
        words[key] = (f"; preempts {names} at {datetime.fromtimestamp(at, timezone.utc):%H:%M:%S} UTC, once "
                      f"{'they have' if len(chosen.victims) > 1 else 'it has'} run the pool's min_run ({min_run})")
    return words


def _why(snap: Any, planned: PlannedPreemption, placements: dict[str, Placement]) -> str:
    """Why the queue preempts for ``planned.job``: its deadline at risk, its tenant taking back what others
    borrowed, or the service it received."""
    job = next(q for q in snap.queued if q.id == planned.job)
    p = placements.get(job.id)
    if p is not None and deadline_at_risk(job, p, snap.now) and job.deadline is not None:
        at = datetime.fromtimestamp(job.deadline, timezone.utc)
        return f"its deadline {at:%H:%M:%S} UTC would be missed otherwise"
    lenders = sorted({r.tenant for r in snap.running if r.id in planned.preemption.victims} - {job.tenant}) \
        if getattr(snap, "tenancy", None) is not None else []
    if lenders:
        return (f"tenant {job.tenant} takes back, within its quota, what tenant{'s' if len(lenders) > 1 else ''} "
                f"{', '.join(lenders)} borrowed")
    return (f"it has received {job.attained_s / 3600:.1f} {'GPU' if job.gpus else 'CPU'}-hours and the preempted "
            "runs far more (jobs that declare no duration are served least-served first)")


def start(write: Any, snap: Any, planned: list[PlannedPreemption], placements: list[Placement], logs: Any,
          counts: dict[str, int]) -> set[str]:
    """Carry out the planned preemptions: each victim ``Preempting`` (only when every one of them is as the
    plan saw it), then the job placed behind them, with ``Placed`` and its words.  A preemption one of whose
    victims changed meanwhile (ended, cancelled) stops none of them and places nothing: the next tick plans
    with what is left.  Returns
    the ids of the jobs placed (their waiting words are not written); counts ``preempt`` (victims) and
    ``start``."""
    from e31.flows.queue.record import humane
    from e31.states import placed, preempting

    by_id = {p.job: p for p in placements}
    now = datetime.fromtimestamp(snap.now, timezone.utc)
    done: set[str] = set()
    for each in planned:
        job_id, choice = each.job, each.preemption
        name = snap.specs[job_id].name
        words = f"preempted by {name} ({job_id[:8]}): {_why(snap, each, by_id)}; at {now:%H:%M:%S} UTC"
        # Every victim checked before any is stopped: one that changed since the plan (ended, cancelled)
        # would leave the others stopped for a job that is then not placed.
        if not all(write.current(victim) for victim in choice.victims):
            continue
        stopped = []
        for victim in choice.victims:
            if write.state(victim, preempting(words), check=False, force=False):  # never over a run that ended
                logs.add(victim, f"Preempting: {words}; the work is warned, its newest checkpoint committed and "
                                 "its output returned, then the run is queued again and resumes from there")
                stopped.append(victim)
        counts["preempt"] = counts.get("preempt", 0) + len(stopped)
        if len(stopped) < len(choice.victims):
            continue
        run, p = snap.runs[job_id], by_id[job_id]
        was = record_of(run)
        record = PlacementRecord(node=choice.node, devices=tuple(choice.devices), cpus=p.cpus,
                                 attempt=was.attempt or 0, unstarted=was.unstarted, victims=tuple(choice.victims),
                                 preempted=was.preempted, attained_s=was.attained_s)
        if not write.place(job_id, run, record):
            continue
        them = ", ".join(humane(v, snap) for v in choice.victims)
        message = (f"placed on {choice.node} by preempting {them}: its flow process starts now and stages the "
                   "inputs; the work starts once they have returned their output")
        if write.state(job_id, placed(message, now), check=False):
            logs.add(job_id, f"Placed: {message}")
            counts["start"] = counts.get("start", 0) + 1
            done.add(job_id)
    return done


def requeue(write: Any, snap: Any, logs: Any, counts: dict[str, int]) -> None:
    """Queue each preempted run (:func:`is_preempted`, in ``snap.preempted``) again: ``Queued`` with its
    ``Preempted`` message and what comes next; its placement record keeps its attempt and counts and adds
    the preemption's time, the service this attempt received (its width x the seconds from its attempt's
    start to its end) and the work it threw away (from its newest durable checkpoint, or its attempt's
    start, to the decision; as the flow process counted it in its manifest when it tagged it so,
    :func:`lost_so_far`).  Counted ``requeued``.  A run cancelled while it stopped for its preemption (a
    ``Cancelling`` written after the decision, not named ``Preempting``) ends ``Cancelled`` instead, its
    output returned as its manifest says; counted ``cancel``."""
    from e31.states import cancelled, queued

    now = datetime.fromtimestamp(snap.now, timezone.utc)
    for key in snap.preempted:
        run = snap.runs[key]
        record, spec = record_of(run), snap.specs[key]
        ended = run.state.timestamp.timestamp() if run.state.timestamp is not None else snap.now
        began, decided, cancel = _attempt_times(write.client, key, ended)
        if cancel is not None:  # cancelled while it stopped for the preemption: its output is returned, it ends
            message = f"cancelled while it was being preempted ({cancel}); {run.state.message or 'preempted'}"
            if write.state(key, cancelled(message)):
                logs.add(key, f"Cancelled: {message}")
                counts["cancel"] = counts.get("cancel", 0) + 1
            continue
        # The record first, then the state: a run left Preempted by a failed state write is requeued by a
        # later tick, which finds this preemption already counted (its end is the record's last) and writes
        # only the state; the other order lost the count when the record's write failed.
        if not record.preempted or record.preempted[-1] != ended:
            served = width(spec.request.gpus, spec.request.cpus) * max(0.0, ended - began)
            said = lost_so_far(run)  # the flow process's count (its manifest's), else an estimate from the times
            lost = said if said is not None else \
                record.lost_s + max(0.0, decided - max(checkpoint_at(run) or began, began))
            kept = replace(record.kept(), attempt=run.run_count or 0, preempted=(*record.preempted, ended),
                           attained_s=round(record.attained_s + served, 3), lost_s=round(lost, 3))
            if not write.place(key, run, kept, check=False):
                continue
        message = f"Queued: {run.state.message or 'preempted by the queue'}; queued again, resumes from there"
        if write.state(key, queued(message, now + timedelta(seconds=AHEAD_S))):
            logs.add(key, message)
            counts["requeued"] = counts.get("requeued", 0) + 1


#: The words of a preemption in a requeued run's message (:func:`requeue`): who, why, when.
_PREEMPTED = re.compile(r"preempted by .*?; at \d\d:\d\d:\d\d UTC")


def preempted_clause(message: str | None) -> str:
    """The preemption a waiting run's state ``message`` tells of (``preempted by NAME (ID8): why; at
    HH:MM:SS UTC``), to keep in the reasons written after it while the run waits; "" when none."""
    found = _PREEMPTED.search(message or "")
    return found.group(0) if found else ""


def _attempt_times(client: Any, key: str, ended: float) -> tuple[float, float, str | None]:
    """When the preempted run ``key``'s attempt entered ``Running`` last, when the queue decided to preempt
    it (its last ``Preempting``), Unix seconds (``ended`` for either when its states cannot be read), and
    the message of a cancel written after that decision (``e31 cancel``, the Prefect UI: a ``Cancelling``
    not named ``Preempting``), or None: one read of its states, once per preemption."""
    try:
        states = [(s.timestamp.timestamp(), s) for s in client.read_flow_run_states(key) if s.timestamp is not None]
    except Exception:  # its service and loss are then counted as nothing: the order errs towards serving it sooner
        return ended, ended, None
    began = max((t for t, s in states if s.type.value == "RUNNING" and t <= ended), default=ended)
    decided = max((t for t, s in states if s.name == PREEMPTING and t <= ended), default=ended)
    cancel = next((s.message or "cancel requested" for t, s in reversed(states)
                   if t >= decided and s.type.value == "CANCELLING" and s.name != PREEMPTING), None)
    return began, max(began, decided), cancel


#: How the crash of a run lost with its node while it was being preempted begins: that attempt was a
#: preemption, which uses none of its retries (:func:`e31.flows.queue.snapshot.retries_used`).
PREEMPTED_LOST = "preempted, then lost with its node: "


def preempted_then_lost(state: Any) -> bool:
    """Whether ``state`` is the crash the scheduler wrote for a run lost with its node while it was being
    preempted (:data:`PREEMPTED_LOST`)."""
    return state is not None and state.type.value == "CRASHED" and (state.message or "").startswith(PREEMPTED_LOST)


def is_preempting(state: Any) -> bool:
    """Whether ``state`` is the queue's ``Preempting`` (a cancel of the user's is not)."""
    return state is not None and state.type.value == "CANCELLING" and state.name == PREEMPTING
