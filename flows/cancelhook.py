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

from e31.tasks.manifest_model import ManifestHead, parse_manifest

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
        from e31.flows.queue.mapping import stored_spec
        from e31.tasks import storage
        from e31.tasks.destination import PARTIAL, read_manifest
        from e31.tasks.storage.options import register_destination

        spec = stored_spec(flow_run)  # as of its submission: its deadline may have passed since
        plan = compile_plan(spec)
        register_destination(spec, plan)
        for url in (storage.join(plan.output_url, PARTIAL), plan.output_url):
            manifest = read_manifest(url)
            typed = parse_manifest(manifest)
            if typed is not None and typed.run_id == str(flow_run.id):
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
    head = ManifestHead.of(returned)
    folder = head.folder or "."
    count = len(head.files or ())
    where = "at the top of the destination" if folder == "." else f"in {folder}/ at the destination"
    if head.status == "returning":  # the flow process ended (kill -9) while the output was on its way
        return (f"cancelled: E31 stopped the work and {CUT}: the manifest {where} still "
                f"says returning; the output is kept in the job's scratch on its node, and e31 return "
                f"{head.job or 'JOB'} there (or the job's next run there) delivers it")
    if head.status == "completed":  # the cancel came after the work's end: nothing was stopped
        return (f"cancelled: the work had ended when the cancel came; its output came back whole, completed: "
                f"{count} file(s) {where} (see the manifest there)")
    said = head.message or ""
    if said.endswith("the work did not start"):  # cancelled while it staged or waited behind the job ahead
        return f"{said}; its manifest ({head.status}, {count} file(s)) is {where}"
    return (f"cancelled: E31 stopped the work and returned what it had, {head.status}: "
            f"{count} file(s) {where} (see the manifest there)")


def stopped_by_cancel(manifest: dict[str, Any]) -> bool:
    """Whether ``manifest`` is a cancel's (``partial``, reason ``cancelled``:
    the cancel stopped the work or kept it from starting; or ``preempted``:
    the queue's ``Cancelling`` named ``Preempting`` did).  Any other
    verdict -- ``completed``, another stop's ``partial``, ``failed`` -- was
    reached by the work's own end: a cancel that came after it changes
    nothing, and the run ends in the manifest's state."""
    head = ManifestHead.of(manifest)
    return head.status == "partial" and head.reason in ("cancelled", "preempted")


def keep_manifest_state(flow_run_id: str, manifest: dict[str, Any]) -> bool:
    """A cancel came after the run's work had ended: when the flow run is
    ``Cancelling`` (or was made ``Cancelled``), set it to the state its
    ``manifest`` says (:func:`e31.states.for_manifest`: ``completed`` ->
    Completed, another stop's ``partial`` -> Completed named Partial,
    ``failed`` -> Failed), forced (the server lets a ``Cancelling`` run go
    only to ``Cancelled``).  One read, and one write when needed; returns
    whether it wrote.  Raises what the Prefect client raises."""
    from prefect import get_client
    from prefect.client.schemas.objects import StateType

    from e31.states import for_manifest

    with get_client(sync_client=True) as client:
        now = client.read_flow_run(flow_run_id).state
        if now is None or now.type not in (StateType.CANCELLING, StateType.CANCELLED):
            return False
        client.set_flow_run_state(flow_run_id, for_manifest(manifest), force=True)
    return True


def late_cancel_message(manifest: dict[str, Any]) -> str:
    """The log line of a run whose cancel came after its work had ended."""
    head = ManifestHead.of(manifest)
    folder = head.folder or "."
    where = "at the top of the destination" if folder == "." else f"in {folder}/ at the destination"
    return (f"the cancel came after the work had ended; it changes nothing: the run ends as its manifest says, "
            f"{head.status} ({head.reason}): {len(head.files or ())} file(s) {where}")


def settle_cancelled(flow: Any, flow_run: Any, state: Any) -> None:
    """Prefect ``on_cancellation`` hook (Prefect passes ``flow``, ``flow_run``
    and ``state`` by name): log what came back (:func:`cancelled_message`)
    and move a run still ``Cancelling`` to ``Cancelled`` with it.  Where no
    runner or worker owns the cancellation the server would otherwise
    refuse the engine's final state and the run would stay ``Cancelling``.
    When the run's manifest is not a cancel's (:func:`stopped_by_cancel`:
    the cancel came after the work had ended), the run ends in the state
    that manifest says instead (:func:`keep_manifest_state`)."""
    from prefect import get_client
    from prefect.logging.loggers import flow_run_logger

    from e31.prefect_compat.cancelgate import guard_worker_cancel
    from e31.states import cancelled
    from e31.tasks.storage import scrub

    from e31.states import PREEMPTED

    if getattr(state, "name", None) == PREEMPTED:  # the queue's preemption, ended as the flow said: queued again
        return
    guard_worker_cancel()  # (run by a worker: its forced Cancelled, next, does not overwrite the manifest's state)
    returned = returned_by(flow_run)
    if isinstance(returned, dict) and ManifestHead.of(returned).status != "returning" and \
            not stopped_by_cancel(returned):
        try:
            flow_run_logger(flow_run).warning("%s", scrub(late_cancel_message(returned)))
        except Exception:  # the log line is a courtesy
            pass
        keep_manifest_state(str(flow_run.id), returned)
        if _hook_process():  # Prefect's worker forces Cancelled after the hooks, from a process E31 cannot guard
            _restore_after_worker(str(flow_run.id), returned)
        return
    message = scrub(cancelled_message(returned))
    try:
        flow_run_logger(flow_run).info("%s", message)
    except Exception:  # the log line is a courtesy
        pass
    with get_client(sync_client=True) as client:
        now = client.read_flow_run(flow_run.id).state
        if now is not None and now.is_cancelling():
            client.set_flow_run_state(flow_run.id, cancelled(message))


#: Seconds :func:`restore_manifest_state` watches a run for the ``Cancelled`` its worker forces after the hooks.
RESTORE_WITHIN_S = 60.0


def _hook_process() -> bool:
    """Whether this process runs the hook alone, away from the process that
    cancels the run: Prefect 3.9's process worker runs the hooks of a run
    it did not start from a module path in a process of their own
    (``WorkspaceHookRunner``: ``python .../_workspace_runtime_bootstrap.py
    hook ...``), then forces ``Cancelled`` from its own process, where
    :func:`e31.prefect_compat.cancelgate.guard_worker_cancel` never ran.  The ``e31 worker``, a runner
    (``flow.serve``) and the flow process itself run the hooks in-process."""
    import sys

    return bool(sys.argv) and sys.argv[0].replace("\\", "/").endswith("/_workspace_runtime_bootstrap.py")


def _restore_after_worker(flow_run_id: str, manifest: dict[str, Any]) -> None:
    """Start :func:`restore_manifest_state` in a process of its own (its own
    session: the hook's process ends at once, and the worker waits for it)."""
    import json
    import subprocess
    import sys

    from e31.states import manifest_state

    code = "import sys, json; from e31.flows.cancelhook import restore_manifest_state as r; " \
           "r(sys.argv[1], json.loads(sys.argv[2]))"
    try:
        subprocess.Popen([sys.executable, "-c", code, flow_run_id, json.dumps(manifest_state(manifest))],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    except OSError:
        pass


def restore_manifest_state(flow_run_id: str, want: dict[str, str], within_s: float = RESTORE_WITHIN_S) -> bool:
    """Under Prefect's own process worker, whose ``Cancelled`` comes after
    the hooks and from a process E31's code does not run in: watch the run
    (a read every 0.5 s, at most ``within_s`` seconds) and, once it is
    ``Cancelled``, set it back to ``want`` (:func:`e31.states.manifest_state`
    of its manifest: ``type``, ``name``, ``message``), forced.  The run
    shows ``Cancelled`` for that moment.  Returns whether it set it."""
    import time

    from prefect import get_client
    from prefect.client.schemas.objects import StateType

    from e31.states import from_record

    deadline = time.monotonic() + within_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            try:
                now = client.read_flow_run(flow_run_id).state
                if now is not None and now.type == StateType.CANCELLED:
                    client.set_flow_run_state(flow_run_id, from_record(want), force=True)
                    return True
            except Exception:  # the API is busy or away: try again
                pass
            time.sleep(0.5)
    return False
