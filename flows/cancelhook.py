"""The ``run_job`` flow's ``on_cancellation`` hook: a cancelled run ends
``Cancelled`` with a state message (and a log line) saying what came back.

Prefect runs the hook in the flow process when no runner or worker owns
the cancellation (``e31 run``, a call from Python), and in the worker's
process after the flow process ended when a worker does (Prefect 3.9's
``CancellationManager``: kill, hooks, then its own ``Cancelled`` "Flow run
was cancelled successfully.", forced after the hook's).  In the flow
process the manifest this run wrote is known (:data:`RETURNED`); in the
worker it is read at the job's destination (``partial/``, then the top),
taken only when its ``run_id`` is this run's."""

from __future__ import annotations

from typing import Any

#: Flow run id -> the manifest this process's run wrote at its destination.
RETURNED: dict[str, dict[str, Any]] = {}

#: The words of a ``Cancelled`` message whose return was cut (the worker may finish it:
#: :mod:`e31.deployments.cutreturn`, which then sets the message anew).
CUT = "its return was cut before the end"

#: What :func:`returned_by` answers when the destination could not be read.
UNKNOWN = object()


def returned_by(flow_run: Any) -> dict[str, Any] | None | object:
    """The manifest the flow run wrote (a dict), None when none of its
    manifests is at its destination, or :data:`UNKNOWN` when that could not
    be read (no valid ``spec`` parameter, credentials only the flow process
    had, a destination that does not answer)."""
    known = RETURNED.get(str(flow_run.id))
    if known is not None:
        return known
    try:
        from e31.flows.compile import compile_plan
        from e31.specs import JobSpec
        from e31.tasks import storage
        from e31.tasks.destination import PARTIAL, read_manifest
        from e31.tasks.storage.options import register_destination

        spec = JobSpec.model_validate((flow_run.parameters or {})["spec"])
        plan = compile_plan(spec)
        register_destination(spec, plan)
        for url in (storage.join(plan.output_url, PARTIAL), plan.output_url):
            manifest = read_manifest(url)
            if manifest is not None and manifest.get("run_id") == str(flow_run.id):
                return manifest
    except Exception:
        return UNKNOWN
    return None


def cancelled_message(returned: dict[str, Any] | None | object) -> str:
    """The ``Cancelled`` state's message for what :func:`returned_by` found."""
    if returned is UNKNOWN:
        return "cancelled: E31 stopped the work; the manifest at the job's destination says what came back"
    if returned is None:
        return "cancelled: E31 stopped the run before it returned any output (no manifest was written)"
    folder = returned.get("folder") or "."
    where = "at the top of the destination" if folder == "." else f"in {folder}/ at the destination"
    if returned["status"] == "returning":  # the flow process ended (kill -9) while the output was on its way
        return (f"cancelled: E31 stopped the work and {CUT}: the manifest {where} still "
                f"says returning; the output is kept in the job's scratch on its node, and e31 return "
                f"{returned.get('job') or 'JOB'} there (or the job's next run there) delivers it")
    if returned["status"] == "completed":  # the cancel came after the work's end: nothing was stopped
        return (f"cancelled: the work had ended when the cancel came; its output came back whole, completed: "
                f"{len(returned.get('files') or ())} file(s) {where} (see the manifest there)")
    said = str(returned.get("message") or "")
    if said.endswith("the work did not start"):  # cancelled while it staged or waited behind the job ahead
        return (f"{said}; its manifest ({returned['status']}, {len(returned.get('files') or ())} file(s)) is "
                f"{where}")
    return (f"cancelled: E31 stopped the work and returned what it had, {returned['status']}: "
            f"{len(returned.get('files') or ())} file(s) {where} (see the manifest there)")


def settle_cancelled(flow: Any, flow_run: Any, state: Any) -> None:
    """Prefect ``on_cancellation`` hook (Prefect passes ``flow``, ``flow_run``
    and ``state`` by name): log what came back (:func:`cancelled_message`)
    and move a run still ``Cancelling`` to ``Cancelled`` with it.  Where no
    runner or worker owns the cancellation the server would otherwise
    refuse the engine's final state and the run would stay ``Cancelling``."""
    from prefect import get_client
    from prefect.logging.loggers import flow_run_logger
    from prefect.states import Cancelled

    from e31.tasks.storage import scrub

    message = scrub(cancelled_message(returned_by(flow_run)))
    try:
        flow_run_logger(flow_run).info("%s", message)
    except Exception:  # the log line is a courtesy
        pass
    with get_client(sync_client=True) as client:
        now = client.read_flow_run(flow_run.id).state
        if now is not None and now.is_cancelling():
            client.set_flow_run_state(flow_run.id, Cancelled(message=message))
