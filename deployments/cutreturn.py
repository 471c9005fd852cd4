"""The worker finishes a return its flow process did not.

A return, once begun, is not stopped by SIGTERM or SIGINT
(:func:`e31.tasks.pending.recorded_return`), but a flow process can still
die in the middle of one: Prefect's worker kills it with SIGKILL 30 s after
the SIGTERM of a cancel (a big output to a slow store takes longer), the
kernel's OOM killer, a kill -9.  The destination then holds a ``returning``
manifest (honest: its files are in flux) and the job's scratch a pending
record (``return-pending.json``) whose ``error`` says the return was under
way.  Without this, only ``e31 return JOB`` on that machine or the job's
next run there would finish it.

``e31 worker`` calls :func:`finish_cut_return` once a flow process it
started has ended: when the job's pending record is that flow run's and
was cut (not a return that failed on its own, which the run already
reported), it delivers it under the job's lock, logs what it did to the
run's log, and sets the run's state from the manifest (see
:func:`settle_state`).
"""

from __future__ import annotations

from typing import Any, Callable

from e31.states import RETURNING  # the Pending state's name of a run whose cut return its worker finishes
from e31.tasks.manifest_model import Manifest
from e31.tasks.pending import cut_return_of


def hold_cut_return(job: Any, flow_run_id: str) -> bool:
    """As soon as the flow process of ``flow_run_id`` (of job ``job``) has
    ended, before anything slower: when it cut a return
    (:func:`cut_return_of`), hold the run ``Pending``
    (:func:`hold_returning`) over the ``Crashed`` Prefect's worker has just
    written, so the node stays the run's while :func:`finish_cut_return`
    delivers.  Returns whether a cut return was found."""
    from e31.flows.compile import default_scratch_root

    if not isinstance(job, str) or not cut_return_of(default_scratch_root() / job, flow_run_id):
        return False
    hold_returning(flow_run_id)
    return True


async def hand_cut_return(client: Any, run: Any, job: str, node: str,
                          logger: Any, finish: Callable[[Any, str], None]) -> int | None:
    """For :func:`e31.deployments.leftovers.end_orphans`, a worker started
    again that found ``run`` with no flow process, its return cut in this
    machine's scratch or its state ``Returning``: hold it ``Returning`` and
    hand the return to ``finish``, under the job's lock taken here and taken
    over by the finish (:func:`e31.flows.joblock.hold_for_run`).  Whoever
    finishes a return delivers it and sets the run's state under that lock
    (:func:`finish_cut_return`), and a second worker for the node looks and
    writes only under it: it can neither write ``Returning`` over the state
    the finish has just set nor crash a run whose return was just
    delivered.  Returns 1 when handed; 0 when left to another process (the
    lock is held, or the state moved on since ``run`` was read); None when,
    under the lock, the return is not cut and the state is still what was
    read (no return to finish: the caller ends the run as any other)."""
    from e31.flows.compile import default_scratch_root
    from e31.flows.joblock import JobBusyError, hold_for_run, unlock_job
    from e31.states import returning

    scratch = str(default_scratch_root() / job)
    left = ("flow run %s (%s) has no flow process left but its return is being finished here by another "
            "process: left to it")
    try:
        hold_for_run(scratch, job)
    except (JobBusyError, OSError):
        logger.warning(left, run.id, run.name)
        return 0
    handed = False
    try:  # looked at again under the lock: delivered meanwhile (and its state set), or its state moved on
        if (await client.read_flow_run(run.id)).state.id != run.state.id:
            logger.warning(left, run.id, run.name)
            return 0
        if not cut_return_of(scratch, str(run.id)):
            return None
        await client.set_flow_run_state(run.id, returning((
            "its flow process ended during the return of its output, and its worker with it; node "
            f"{node}'s e31 worker started again finishes the return")), force=True)
        logger.warning("flow run %s (%s) was cut in the middle of the return of its output: finishing it",
                       run.id, run.name)
        finish(run, job)
        handed = True
        return 1
    finally:
        if not handed:
            unlock_job(scratch)


def finish_cut_return(job: Any, flow_run_id: str, say: Callable[[str], None],
                      settle: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any] | None:
    """Deliver the cut return of the flow run ``flow_run_id`` of job ``job``
    kept in this machine's scratch (``$E31_SCRATCH/<job>``), then call
    ``settle(manifest)`` (the run's state from it), both under the job's
    lock; returns the manifest, or None when there was none to finish, the
    job's lock is held (a next run of the job here delivers it first thing),
    or the delivery failed (the record stays for ``e31 return``; ``say`` is
    told why).  ``say``: one line for the run's log.  Raises only what
    ``settle`` raises."""
    from e31.flows.compile import default_scratch_root
    from e31.flows.joblock import JobBusyError, lock_job, unlock_job
    from e31.tasks.pending import deliver_pending
    from e31.tasks.storage import scrub

    if not isinstance(job, str):
        return None
    scratch = default_scratch_root() / job
    try:
        lock_job(str(scratch), job)  # or takes over the one end_orphans took for it (hand_cut_return)
    except (JobBusyError, OSError):
        return None
    try:
        if not cut_return_of(scratch, flow_run_id):  # delivered by the lock's last holder: looked at under it
            return None
        try:
            hold_returning(flow_run_id)
            manifest = deliver_pending(scratch)
        except Exception as exc:
            say(f"the return of flow run {flow_run_id} was cut when its flow process ended, and the worker could "
                f"not finish it ({type(exc).__name__}: {scrub(str(exc))}); the output stays in {scratch}: e31 return "
                f"{job} on this machine delivers it")
            return None
        if manifest is not None:
            done = Manifest.model_validate(manifest)
            say(f"the return of flow run {flow_run_id} was cut when its flow process ended; the worker finished it: "
                f"{done.status}, {len(done.files)} file(s)")
            if settle is not None:
                settle(manifest)
        return manifest
    finally:
        unlock_job(str(scratch))


def close_cut_return(job: Any, flow_run_id: str, held: bool, say: Callable[[str], None]) -> None:
    """After the flow process of ``flow_run_id`` ended: a return it left cut
    is delivered and the run's state set from its manifest, under the job's
    lock (:func:`finish_cut_return`, :func:`settle_state`); one ``held``
    Returning (:func:`hold_cut_return`) that could not be finished is crashed
    (:func:`give_up_returning`): the node is free again, and a run with
    retries left is queued again; unless another process here holds the
    job's lock or has already finished the return (a second worker for the
    node finishing the same return: crashing it there would run its retry
    twice, or end a delivered run ``Crashed``).  Raises what the state
    writes raise."""
    from e31.flows.compile import default_scratch_root
    from e31.flows.joblock import lock_busy

    manifest = finish_cut_return(job, flow_run_id, say, lambda m: settle_state(flow_run_id, m))
    if manifest is None and held and (not isinstance(job, str) or (
            not lock_busy(str(default_scratch_root() / job)) and
            cut_return_of(default_scratch_root() / job, flow_run_id))):
        # still cut and nobody here at it: crashed.  A return no longer cut was finished by another process
        # here (a second worker for the node), which set the state from its manifest
        give_up_returning(flow_run_id)


def hold_returning(flow_run_id: str) -> None:
    """While the worker finishes the run's return: a run Prefect's worker
    marked ``Crashed`` (its flow process exited non-zero) is set
    ``Pending`` named :data:`RETURNING`, so the scheduler neither frees its
    node nor queues it again meanwhile (in the moment before, it leaves a
    fresh crash its node: :data:`e31.flows.queue.SETTLE_S`).  ``Pending``, not ``Running``:
    entering ``Running`` counts as an attempt in Prefect's ``run_count``,
    which the scheduler holds against ``request.retries``.  Its lease
    still applies: if this worker dies too, the run is crashed and, with
    retries left, queued again; its next run on this node delivers the
    pending return first (a worker started again crashes it at once, as
    any run left without a process).  Best effort: an API error is
    ignored."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType

    from e31.states import returning

    try:
        with get_client(sync_client=True) as client:
            now = client.read_flow_run(flow_run_id).state
            if now is not None and now.type == StateType.CRASHED:
                client.set_flow_run_state(flow_run_id, returning(
                    "its flow process ended during the return of its output; the node's e31 worker finishes the "
                    "return"), force=True)
    except Exception:
        pass


def give_up_returning(flow_run_id: str) -> bool:
    """A run held ``Pending`` (:data:`RETURNING`) whose cut return the
    worker could not finish (the store failed, or the job's lock is held
    by a run of the same job here, which delivers it first thing) is set
    ``Crashed``, saying where the output is: otherwise it would hold its
    node until its lease.  The scheduler then frees the node, and queues
    the run again when it has retries left.  Returns whether it set it;
    best effort (an API error is ignored)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType

    from e31.states import crashed

    try:
        with get_client(sync_client=True) as client:
            now = client.read_flow_run(flow_run_id).state
            if now is None or now.type != StateType.PENDING or now.name != RETURNING:
                return False
            client.set_flow_run_state(flow_run_id, crashed(
                "its flow process ended during the return of its output, and its worker could not finish "
                        "that return; the output stays in the node's scratch (e31 return JOB there, or the job's "
                        "next run there, delivers it)"), force=True)
            return True
    except Exception:
        return False


def settle_state(flow_run_id: str, manifest: dict[str, Any]) -> bool:
    """Set the flow run's state from ``manifest`` (its verdict:
    :func:`e31.states.for_manifest`) when it is still what the killed
    flow process left: ``Running``, ``Pending`` (:func:`hold_returning`),
    ``Crashed`` (Prefect's worker marks a flow process that exited non-zero
    so, before E31's worker could deliver), or ``Cancelled`` (the cancel hook's "return was cut", or a
    cancel that came while the worker returned: either way the run stays ``Cancelled``, with a message
    that says what was returned).  Any other state is left alone: a run queued again meanwhile
    (Crashed with retries left) runs again.  The state's type and name decide, never its message text.
    Returns whether it set one."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType

    from e31.flows.cancelhook import cancelled_message
    from e31.states import PREEMPTED, cancelled, for_manifest

    with get_client(sync_client=True) as client:
        now = client.read_flow_run(flow_run_id).state
        left = now is not None and now.type in (StateType.RUNNING, StateType.PENDING, StateType.CRASHED,
                                                 StateType.CANCELLED)
        if not left:
            return False
        if now is not None and now.is_cancelled() and now.name != PREEMPTED:  # a preempted run stays one
            client.set_flow_run_state(flow_run_id, cancelled(cancelled_message(manifest)), force=True)
            return True
        client.set_flow_run_state(flow_run_id, for_manifest(manifest), force=True)
        return True
