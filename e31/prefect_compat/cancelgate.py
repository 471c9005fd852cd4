"""A cancel that reaches a Prefect worker after a run's work has ended
changes nothing: the run returns its output whole and ends in the state its
manifest says.

Prefect 3.9's process worker answers every ``Cancelling`` run it started
with one sequence (``prefect.runner._cancellation_manager.CancellationManager.cancel``):
SIGTERM to the flow process, SIGKILL 30 s later, the ``on_cancellation``
hooks, then a forced ``Cancelled`` ("Flow run was cancelled
successfully.").  For a run whose work had ended that sequence cut a long
return at its SIGKILL and, even when the return finished, wrote
``Cancelled`` over a run whose manifest says ``completed``.
:func:`guard_worker_cancel` (:func:`install`) makes the worker's process

- skip the sequence for a run tagged as having ended its work
  (:data:`e31.tasks.supervisor.marks.WORK_ENDED`, written by the flow
  process as the work ends): no signal, no kill; the flow process finishes
  its return and sets its state from the manifest;
- skip the sequence for a run the queue is preempting (a ``Preempting``
  state after its last ``Running``): its flow process is already stopping
  and returning its output; the scheduler ends it ``Cancelled`` once that
  output is returned;
- never force ``Cancelled`` over a run that is already in another final
  state (the flow process, or E31's hook, set it from the manifest), nor
  over a ``Preempted`` run (the scheduler reads that run's cancel): as
  Prefect itself does when a cancelled flow process concluded on its own
  (``should_skip_cancel_after_acked_process_exit``).

A run still ``Cancelling`` after its flow process ended, whose work had
ended, is set from its manifest by the worker
(:func:`e31.deployments.killinfra.settle_late_cancel`).

Measured on Prefect 3.9.1.  Upstream offers no hook into this sequence:
a worker's documented ``kill_infrastructure`` (which the ``e31`` worker
overrides, :mod:`e31.deployments.killinfra`) is called only for a run
cancelled before it started and for the server's cancelling-timeout
teardown, not in this sequence; ``on_cancellation`` hooks run after the kill.
It wraps two private members of Prefect's runner (``CancellationManager.cancel``,
``StateProposer.propose_cancelled``), which ``tests/test_prefect_privates.py``
guards.
"""

from __future__ import annotations

from typing import Any


def install() -> None:
    """Install the gate in this process (:func:`guard_worker_cancel`)."""
    guard_worker_cancel()


_GUARDED: list[bool] = []


def guard_worker_cancel() -> None:
    """In a Prefect worker's process (once; the ``e31 worker`` calls it as it
    starts, and :func:`e31.flows.cancelhook.settle_cancelled` in any worker
    that runs E31's hook): wrap Prefect 3.9's ``CancellationManager.cancel`` and
    ``StateProposer.propose_cancelled``, the runner classes its process
    worker cancels a run with (SIGTERM to the flow process, SIGKILL 30 s
    later, the ``on_cancellation`` hooks, then a forced ``Cancelled``), so
    that a cancel after a run's work ended changes nothing:

    - a run tagged as having ended its work
      (:data:`e31.tasks.supervisor.marks.WORK_ENDED`) is not signalled or
      killed at all: its flow process finishes the return (a SIGKILL would
      cut a long one) and sets the run's state from its manifest;
    - ``Cancelled`` is never forced over a run already in another final
      state (set from its manifest by the flow process or this hook), as
      Prefect itself skips it when a cancelled flow process concluded on its
      own (``should_skip_cancel_after_acked_process_exit``)."""
    if _GUARDED:
        return
    from prefect.logging.loggers import flow_run_logger
    from prefect.runner._cancellation_manager import CancellationManager
    from prefect.runner._state_proposer import StateProposer

    from e31.states import PREEMPTED
    from e31.tasks.supervisor.marks import work_ended_at

    cancel, propose_cancelled = CancellationManager.cancel, StateProposer.propose_cancelled

    async def cancel_unless_ended(self: Any, flow_run: Any, state_msg: str | None = None) -> None:
        ended = work_ended_at(flow_run)
        if ended is None and await _being_preempted(self._client, flow_run.id):
            try:
                flow_run_logger(flow_run).warning(
                    "flow run %s was cancelled while the queue preempts it: its flow process is already "
                    "stopping and returns its output; it will not be queued again", flow_run.id)
            except Exception:  # the log line is a courtesy
                pass
            return
        if ended is not None:
            try:  # in the run's log, where the cancel's user looks
                flow_run_logger(flow_run).warning(
                    "flow run %s was cancelled after its work had ended (%s): the cancel changes nothing; its "
                    "output is returned whole and the run ends as its manifest says", flow_run.id, ended)
            except Exception:  # the log line is a courtesy
                pass
            return
        await cancel(self, flow_run, state_msg)

    async def propose_unless_final(self: Any, flow_run: Any, state_updates: dict[str, Any] | None = None) -> bool:
        try:
            now = (await self._client.read_flow_run(flow_run.id)).state
        except Exception:
            now = None
        if now is not None and now.is_final() and (not now.is_cancelled() or now.name == PREEMPTED):
            return False  # (Prefect's finalizer then reads the run, finds it final and emits no cancelled event)
        return await propose_cancelled(self, flow_run, state_updates)

    CancellationManager.cancel = cancel_unless_ended  # type: ignore[method-assign]
    StateProposer.propose_cancelled = propose_unless_final  # type: ignore[method-assign]
    _GUARDED.append(True)


async def _being_preempted(client: Any, flow_run_id: Any) -> bool:
    """Whether the queue preempted flow run ``flow_run_id``'s current attempt (a ``Preempting`` state after
    its last ``Running``): its flow process is then already stopping and returning its output, which a
    SIGTERM and a SIGKILL 30 s later would cut; the scheduler ends a run cancelled meanwhile ``Cancelled``
    once that output is returned (:func:`e31.flows.queue.preempt.requeue`).  False when its states cannot
    be read (Prefect's sequence then runs as usual)."""
    from e31.states import PREEMPTING

    try:
        states = sorted((s for s in await client.read_flow_run_states(flow_run_id) if s.timestamp is not None),
                        key=lambda s: s.timestamp)
    except Exception:
        return False
    for state in reversed(states):
        if state.name == PREEMPTING:
            return True
        if state.type.value == "RUNNING":
            return False
    return False
