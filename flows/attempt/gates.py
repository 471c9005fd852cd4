"""Gates: what must hold between an attempt's staging and its work.

A gate is given the attempt and answers None (pass) or the outcome the
attempt returns instead of running its work (``partial``: the work did not
start); it may also end the process (a fenced run) or raise (a fresh run
with no time left).  The attempt takes its gates in order
(:data:`GATES`); a caller may give others (a test, a coming kind of stop).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, NoReturn, Protocol

from prefect import get_run_logger

from e31.flows.admission import AdmissionError
from e31.flows.attempt.fencing import fence
from e31.flows.queue.handover import run_ahead, signals_end_wait, wait_for_run_ahead
from e31.tasks.checkpoint import latest_durable
from e31.tasks.deliver import write_failure_manifest
from e31.tasks.outcome import RunOutcome
from e31.tasks.supervisor.cancel import (CancelWatcher, cancel_reason, cancel_requested, cancel_seen,
                                         cancel_stops_staging)
from e31.tasks.supervisor.marks import mark_checkpoint, mark_work_ended
from e31.tasks.supervisor.fence import step_aside

if TYPE_CHECKING:
    from e31.flows.attempt.attempt import Attempt


class Gate(Protocol):
    """One condition an attempt's work starts under."""

    def __call__(self, attempt: Attempt) -> RunOutcome | None:
        """None when the work may start as far as this gate goes; else the
        outcome to return (its work did not start).  May raise
        :class:`e31.flows.admission.AdmissionError` or end the process."""
        ...


#: Seconds a handed-over run's wait for the run ahead must pass for its staging to count as made before
#: its allocation (the run ahead still held the node when the staging ended): one check of its process.
HANDOVER_HELD_S = 0.1


def handover(attempt: Attempt) -> RunOutcome | None:
    """A run handed over behind another on its node (``E31_AFTER``), or
    placed by preempting others (their ids, comma-separated), waits here
    for each of them to return its output (:mod:`e31.flows.queue.handover`);
    a cancel, a SIGTERM or SIGINT (a drain, Ctrl-C) or a move to another
    node ends the wait.  A signal without a cancel returns ``signal``, a
    cancel ``cancelled``; the time waited is the manifest's
    ``handover_wait_s``."""
    target = attempt.target
    ahead = run_ahead()
    if not ahead or attempt.staging_cancelled:
        return None
    with cancel_stops_staging(target.run_id, str(attempt.plan.data_dir)) as watcher, signals_end_wait() as told:
        stop = lambda: watcher.cancelled() or bool(told) or watcher.moved_to() is not None  # noqa: E731
        target.handover_wait_s = 0.0
        for each in ahead.split(","):  # a placement that preempts waits for every run it stops
            if each and not stop():
                target.handover_wait_s += wait_for_run_ahead(each, stop=stop, say=get_run_logger().info,
                                                              me=target.run_id)
    cancelled = watcher.cancelled()
    if target.handover_wait_s > HANDOVER_HELD_S:  # the run ahead still held the node: staged before allocation
        target.handover_staging_s, target.staging_s = target.staging_s, 0.0
        target.staged_before_allocation = True if attempt.staged_any else None
    fence(attempt.plan, target.run_id)  # placed elsewhere while it waited: the work never starts here
    if told and not cancelled and not cancel_requested(target.run_id):  # a drain or Ctrl-C during the wait
        return RunOutcome(reason="signal", exit_code=None, run_s=0.0,
                          message="stopped by a signal while it waited for the job ahead of it on its node; the "
                                  "work did not start")
    if cancelled or told:
        return _cancelled(attempt, watcher.stop_reason() if cancelled else cancel_reason(target.run_id))
    return None


def placed_here(attempt: Attempt) -> RunOutcome | None:
    """A run placed on another node while it staged never starts its work
    here: the process ends, writing nothing more
    (:func:`e31.flows.attempt.fencing.fence`)."""
    fence(attempt.plan, attempt.target.run_id)
    return None


def not_cancelled(attempt: Attempt) -> RunOutcome | None:
    """A cancel seen while the inputs staged (or as the run waited) keeps
    the work from starting: ``cancelled``.  The run's state is as the
    reader saw it last (<= 2 s ago): a cancel since then reaches the work
    through the run's own watch of the same reader."""
    if attempt.staging_cancelled or cancel_seen(attempt.target.run_id):
        return _cancelled(attempt, cancel_reason(attempt.target.run_id))
    return None


def time_left(attempt: Attempt) -> RunOutcome | None:
    """The run's deadline (less the return reserve and the grace period)
    must leave time for its work now.  A fresh run without it writes a
    failed manifest and raises :class:`AdmissionError`; a run an earlier
    attempt began returns what that attempt left (``crashed`` or the
    earlier stop's reason).  Taken as the attempt starts and again after
    its staging and any wait behind the job ahead, which may overrun."""
    plan, resume = attempt.plan, attempt.resume
    now = time.time()
    stop_at, stop_reason = plan.stop_at(now)
    if stop_at - plan.grace_s > now:
        return None
    if not (resume.crashed or resume.step is not None):
        # said at the destination too, so a queued run placed too late for its deadline does not end Failed
        # with no manifest; an earlier complete output stays as it was
        why = no_time(attempt, now, stop_at)
        write_failure_manifest(attempt.target, why)
        raise AdmissionError(why)
    earlier = "was lost" if resume.crashed else "stopped early"
    return RunOutcome(reason="crashed" if resume.crashed else stop_reason, exit_code=None, run_s=0.0,
                      checkpoint=latest_durable(plan.checkpoint_url),
                      message=f"an earlier attempt {earlier} and the job can no longer run: "
                              f"its {stop_reason.replace('_', ' ')}, less the return reserve, has passed")


def no_time(attempt: Attempt, now: float, stop_at: float) -> str:
    """Why a run cannot start before its deadline, naming the deadline field
    the spec gave, the resolved times (UTC) and the fix."""
    req, plan = attempt.spec.request, attempt.plan
    field = ("request.deadline_within" if req.deadline_within is not None else
             "request.deadline_at" if req.deadline_at is not None else "request.deadline")

    def utc(seconds: float) -> str:
        return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")

    deadline = plan.deadline.timestamp() if plan.deadline else stop_at
    return (f"{field}: the deadline {utc(deadline)} ({plan.deadline_kind or 'absolute'}) leaves no time to run: the "
            f"work would have to stop by {utc(stop_at)} ({plan.return_reserve_s:g} s before it, to return the output) "
            f"and it is {utc(now)}, with {plan.grace_s:g} s of grace; give a later deadline or start the job sooner")


def _cancelled(attempt: Attempt, reason: str = "cancelled") -> RunOutcome:
    """The outcome of a cancel (``reason`` ``cancelled``) or a preemption (``preempted``) seen before the
    work started."""
    when = "it waited for the job ahead of it on its node" if attempt.target.handover_wait_s else \
        "the inputs were staged"
    return RunOutcome(reason=reason, exit_code=None, run_s=0.0,
                      message=f"{reason} while {when}; the work did not start")


#: The gates every attempt takes, in order, between its staging and its work.
GATES: tuple[Gate, ...] = (handover, placed_here, not_cancelled, time_left)


class RunGates(CancelWatcher):
    """The gates the run task is given while the work runs
    (:class:`e31.tasks.supervisor.watch.RunWatch`): a cancel stops the work,
    a move of the run to another node ends this flow process with nothing
    more written (:func:`e31.tasks.supervisor.fence.step_aside`), and the
    work's own end makes a later cancel change nothing
    (:func:`e31.tasks.supervisor.marks.mark_work_ended`), and each durable
    checkpoint is tagged (:func:`e31.tasks.supervisor.marks.mark_checkpoint`).  Reads share the
    one reader of the flow run's state (:class:`CancelWatcher`)."""

    def step_aside(self, moved: str) -> NoReturn:
        step_aside(self.flow_run_id, moved)
        raise SystemExit(0)  # (step_aside ends the process; never reached)

    def work_ended(self) -> None:
        mark_work_ended(self.flow_run_id)

    def checkpoint_durable(self) -> None:
        mark_checkpoint(self.flow_run_id)

    def warned(self, reason: str) -> None:
        from e31.flows.gang.lead import warn_members

        warn_members(self.flow_run_id, reason)

    def peer_failed(self) -> tuple[bool, str] | None:
        from e31.flows.gang.lead import member_failed

        return member_failed(self.flow_run_id, self._reader.last if self._reader is not None else None)

    def peer_lost(self) -> str | None:
        from e31.flows.gang.lead import member_lost

        return member_lost(self.flow_run_id)
