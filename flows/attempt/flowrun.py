"""An attempt inside the ``run_job`` flow run: what its end makes of the
flow run's state, and what must happen at the end however it ended."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger
from prefect.runtime import flow_run

from e31.errors import E31Error
from e31.flows.attempt.attempt import Attempt
from e31.flows.attempt.errors import JobFailedError, PreemptedStop
from e31.flows.attempt.fencing import fence_at_end, leave_to_first_process
from e31.flows.cancelhook import RETURNED, keep_manifest_state, late_cancel_message, stopped_by_cancel
from e31.flows.queue.handover import release
from e31.flows.resume import JobBusyError
from e31.prefect_compat.runlog import drop_explained_failures
from e31 import states
from e31.specs import JobSpec
from e31.tasks.manifest import step_text
from e31.tasks.manifest_model import Manifest
from e31.tasks.storage import scrub
from e31.tasks.storage.masked_errors import masked_exception
from e31.tasks.storage.masking import install_log_masking
from e31.tasks.supervisor.fence import this_node
from e31.tasks.supervisor.process import SIGNALLED, end_signal_deferral


def run_in_flow(spec: JobSpec, code_dir: str | None) -> Any:
    """Run one :class:`Attempt` of ``spec`` in the current flow run and
    return what the flow returns: the manifest (a dict), or a Prefect
    state for an end that is not a plain ``Completed``: ``Completed``
    named ``Partial`` (a stop other than a cancel), ``Cancelled`` named
    ``Refused`` (the same job runs here already), ``Failed`` with the
    one-line message of an E31 error (a caller gets it raised).  Whatever
    the end, the run handed over behind this one is released and the
    fence is checked before the engine writes the final state.  Any other
    exception is raised masked (a client's text may quote a signed URL)."""
    install_log_masking()  # every log line of the run is masked, whoever writes it
    drop_explained_failures()  # an E31 error ends the run in one line, not with the engine's traceback too
    SIGNALLED.clear()
    run_id = str(flow_run.id) if flow_run.id else None
    leaving = None
    try:
        try:
            manifest = Attempt(spec, code_dir).run()
            RETURNED[str(flow_run.id)] = manifest
            late_cancel(manifest)
        except JobFailedError as exc:
            RETURNED[str(flow_run.id)] = exc.manifest
            late_cancel(exc.manifest)
            raise
        except JobBusyError as exc:
            if run_id and exc.holder_run == run_id:
                leave_to_first_process(exc)  # never returns: the release below is the first process's
            raise
        finally:  # the output is returned (or cannot be): a run handed over behind this one starts its work
            end_signal_deferral()
            release(run_id)  # (at the latest: the return released it already)
            fence_at_end(run_id)
    except JobBusyError as exc:  # refused, not failed: the job's history shows no failure that never ran
        get_run_logger().warning("%s", scrub(str(exc)))
        return states.refused_busy(scrub(str(exc)), data=exc)
    except E31Error as exc:  # explained in one line: the flow run fails with it, no traceback in the logs
        get_run_logger().error("%s", scrub(str(exc)))
        return states.failed(scrub(str(exc)), data=masked_exception(exc))  # a caller gets it raised
    except Exception as exc:  # Prefect makes the state's message of its text: a client's may quote a signed URL
        leaving = masked_exception(exc)
    if leaving is not None:
        raise leaving  # (outside the handler: nothing is chained to it)
    m = Manifest.model_validate(manifest)
    if m.status == "partial" and m.reason == "preempted":  # the queue takes it back (e31.flows.queue.preempt)
        from e31.tasks.supervisor.marks import mark_lost

        mark_lost(run_id, m.lost_s)  # the work thrown away, as the manifest counts it: kept across attempts
        said = preempted_message(run_id, m)
        return states.preempted(said, data=PreemptedStop(said, manifest))
    if m.status != "partial" or m.reason == "cancelled":
        return manifest  # (a cancelled run's state is Prefect's: a State returned here would make the call raise)
    return states.partial(f"partial ({m.reason}): {step_text(m.step)}; {m.message}".rstrip("; "), data=manifest)


def late_cancel(manifest: dict[str, Any]) -> None:
    """A cancel that came after the work had ended changes nothing: the run
    ends in its manifest's state (:func:`e31.flows.cancelhook.keep_manifest_state`),
    set here when the run is ``Cancelling`` now.  Read in a flow process an
    ``e31 worker`` started (which skips the cancel of a run whose work had
    ended: :mod:`e31.prefect_compat.cancelgate`), or after a signal was held
    back for the return (a worker's, after a cancel); elsewhere the engine's
    final state meets the cancel and the ``on_cancellation`` hook
    (:func:`e31.flows.cancelhook.settle_cancelled`) does the same.  Best
    effort: an API error leaves it to that hook and the worker."""
    if not flow_run.id or stopped_by_cancel(manifest) or not (SIGNALLED.is_set() or this_node() is not None):
        return
    try:
        if keep_manifest_state(str(flow_run.id), manifest):
            get_run_logger().warning("%s", scrub(late_cancel_message(manifest)))
    except Exception:
        pass


def preempted_message(run_id: str | None, manifest: Manifest) -> str:
    """The ``Preempted`` state's message: the queue's words on the preemption
    (its last ``Preempting`` state's message, read once: who preempted the run,
    why and when) and what came back, e.g. ``preempted by retrain-7
    (1c9f0a2e): its deadline 06:00 UTC is at risk, at 02:41 UTC; returned
    step 1200 (partial)``.  The queue's words are left out when the API does
    not answer."""
    said = None
    if run_id:
        try:
            from prefect.client.orchestration import get_client

            with get_client(sync_client=True) as client:  # its last Preempting (a cancel may have come after it)
                said = next((s.message for s in sorted((s for s in client.read_flow_run_states(run_id)
                                                       if s.timestamp is not None), key=lambda s: s.timestamp,
                                                      reverse=True) if s.name == states.PREEMPTING), None)
        except Exception:  # the words are a courtesy: the manifest says what came back
            said = None
    returned = f"returned {step_text(manifest.step)} (partial)"
    return f"{scrub(said)}; {returned}" if said else f"preempted by the queue; {returned}"
