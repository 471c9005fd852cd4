"""A cancel that reaches an ``e31 worker`` after a run's work has ended
changes nothing: the run returns its output whole and ends in the state its
manifest says.

Prefect 3.9's process worker answers every ``Cancelling`` run it started
with one sequence (``prefect.runner._cancellation_manager.CancellationManager.cancel``):
SIGTERM to the flow process, SIGKILL 30 s later, the ``on_cancellation``
hooks, then a forced ``Cancelled`` ("Flow run was cancelled
successfully.").  For a run whose work had ended that sequence cut a long
return at its SIGKILL and, even when the return finished, wrote
``Cancelled`` over a run whose manifest says ``completed``.
:func:`install` (:func:`e31.flows.cancelhook.guard_worker_cancel`) makes
the worker's process

- skip the sequence for a run tagged as having ended its work
  (:data:`e31.tasks.supervisor.cancel.WORK_ENDED`, written by the flow
  process as the work ends): no signal, no kill; the flow process finishes
  its return and sets its state from the manifest;
- never force ``Cancelled`` over a run that is already in another final
  state (the flow process, or E31's hook, set it from the manifest): as
  Prefect itself does when a cancelled flow process concluded on its own
  (``should_skip_cancel_after_acked_process_exit``).

A run still ``Cancelling`` after its flow process ended, whose work had
ended, is set from its manifest by :func:`settle_late_cancel`."""

from __future__ import annotations

from typing import Any


def install() -> None:
    """Install the gate in this process (:func:`e31.flows.cancelhook.guard_worker_cancel`)."""
    from e31.flows.cancelhook import guard_worker_cancel

    guard_worker_cancel()


def settle_late_cancel(flow_run: Any) -> bool:
    """After the flow process of ``flow_run`` (a Prefect ``FlowRun``) ended:
    a run still ``Cancelling`` whose work had ended (tagged
    :data:`e31.tasks.supervisor.cancel.WORK_ENDED`) is set to the state of
    the manifest it wrote (read at its destination:
    :func:`e31.flows.cancelhook.returned_by`), when that manifest is not a
    cancel's.  Returns whether it set one; never raises (a destination the
    worker cannot read leaves the run to ``end_cancelling``)."""
    from prefect.client.orchestration import get_client

    from e31.flows.cancelhook import keep_manifest_state, returned_by, stopped_by_cancel
    from e31.tasks.supervisor.cancel import work_ended_at

    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run.id)
        if run.state is None or not run.state.is_cancelling() or work_ended_at(run) is None:
            return False
        manifest = returned_by(run)
        if not isinstance(manifest, dict) or manifest.get("status") == "returning" or stopped_by_cancel(manifest):
            return False
        return keep_manifest_state(str(run.id), manifest)
    except Exception:
        return False
