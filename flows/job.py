"""``run_job``: the one static Prefect flow every E31 job runs as.

stage (one task per input, concurrent) -> run (supervised child process,
submitting a checkpoint task per durable checkpoint) -> return (output and
manifest).  Usable from Python (``run_job(load_spec("x.yaml"))`` returns the
manifest), from the ``e31`` CLI, and as a deployment entrypoint
(``flows/job.py:run_job``).
"""

from __future__ import annotations

import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Cancelled, Completed, Failed

from e31.errors import E31Error
from e31.flows.compile import JobPlan, compile_plan, describe_markdown
from e31.flows.admission import AdmissionError, check_fits
from e31.flows.cancelhook import RETURNED, keep_manifest_state, late_cancel_message, settle_cancelled, stopped_by_cancel
from e31.flows.deploy import FLOW_NAME
from e31.prefect_compat.statesync import settle_earlier_run
from e31.flows.workconfig import child_config
from e31.flows.resume import JobBusyError, Resume, end_attempt, open_scratch, remove_stale_checkpoints, resume_step
from e31.specs import JobSpec, mask_url
from e31.tasks.checkpoint import latest_durable
from e31.tasks.supervisor.cancel import cancel_requested, cancel_seen, cancel_stops_staging, mark_work_started, watching
from e31.flows.attempt import attempt_token, fence, fence_at_end, leave_to_first_process
from e31.tasks.storage.credentials import CredentialError
from e31.tasks.deliver import (ON_DELIVERED, ReturnTarget, check_destination, deliver, delivered,
                           publish_artifacts, return_task, write_failure_manifest)
from e31.tasks.manifest import step_text
from e31.tasks.manifest_model import Manifest
from e31.tasks.outcome import ChildLost, RunOutcome
from e31.prefect_compat.api import api_answers
from e31.tasks.supervisor.fence import this_node
from e31.tasks.supervisor.process import SIGNALLED, end_signal_deferral, signals_deferred
from e31.tasks.supervisor.warm import discard, prestart
from e31.flows.exitsignals import hold_signals
from e31.flows.queue.handover import release, run_ahead, signals_end_wait, wait_for_run_ahead
from e31.tasks.run import SupervisorConfig, run_task
from e31.tasks.pending import RETURNING_FIRST, deliver_pending, permanent, recorded_return
from e31.tasks.stage import StageError, StagingCancelled, preflight, stage_task
from e31.tasks.storage.scratch_cache import data_wait_s, prefetched_seconds
from e31.tasks.storage.transfer_markers import transferring
from e31.tasks.storage import describe_error, scrub
from e31.prefect_compat.runlog import drop_explained_failures
from e31.tasks.storage.masking import install_log_masking
from e31.tasks.storage.masked_errors import masked_exception
from e31.tasks.storage.options import register_destination, register_inputs


if release not in ON_DELIVERED:  # a run handed over behind this one starts its work once the output is returned
    ON_DELIVERED.append(release)


class ReturnError(E31Error, RuntimeError):
    """The output could not be delivered to ``output.url``; it is kept in the
    job's scratch folder (``output/``, ``checkpoints/``), nothing deleted."""

    def __init__(self, plan: JobPlan, cause: BaseException):
        self.scratch = plan.scratch
        if permanent(cause):
            super().__init__(
                f"cannot return the output to {mask_url(plan.output_url)}: {describe_error(cause, plan.output_url)}; "
                f"no later try can change that (a failed manifest in partial/ says so); it is kept in "
                f"{plan.output_dir}: change the work so its files can be written there, and run the job again")
            return
        super().__init__(
            f"could not return the output to {mask_url(plan.output_url)}: {describe_error(cause, plan.output_url)}; "
            f"it is kept in {plan.output_dir} (checkpoints in {plan.checkpoint_dir}); deliver it later with: "
            f"e31 return {plan.job}"
        )


class JobFailedError(E31Error, RuntimeError):
    """The job ended ``failed``; ``manifest`` is what was written to the
    destination (the latest checkpoint and any output still came back)."""

    def __init__(self, manifest: dict[str, Any]):
        self.manifest = manifest
        m = Manifest.model_validate(manifest)
        detail = m.message or "work failed"
        tail = m.stderr_tail
        super().__init__(f"job {m.job} failed: {detail}" + (f"\n--- stderr (last lines) ---\n{tail}" if tail else ""))


@flow(name=FLOW_NAME, flow_run_name="{spec.name}", persist_result=False, on_cancellation=[settle_cancelled])
def run_job(spec: JobSpec, code_dir: str | None = None, placement: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one declared job to its end and return its manifest (a dict, see
    docs/design.md §2).  A ``partial`` job's flow run ends ``Completed`` with the
    state name ``Partial`` (the UI tells it from a whole one); a cancelled
    one ends ``Cancelled``.

    ``code_dir``: a folder put first on the work's ``sys.path`` (the CLI
    passes the spec file's folder, so work code can sit beside its spec).
    ``placement``: written by the E31 scheduler on a queued run (its node,
    GPU devices, CPUs: :data:`e31.tasks.supervisor.fence.PLACEMENT_PARAM`),
    which the node's ``e31 worker`` reads to start it there with exactly
    those devices; the run itself takes them from its environment.  None
    elsewhere; leave it unset.
    Raises, each with a one-line message:
    :class:`e31.flows.admission.AdmissionError` (the request does not fit this
    machine, or its deadline leaves no time), ``e31.tasks.deliver.DestinationError``
    (``output.url`` is not writable; checked before anything runs),
    ``e31.flows.resume.JobBusyError`` (the same job runs here already; the
    flow run ends ``Cancelled`` named ``Refused``, not ``Failed``),
    ``e31.tasks.stage.StageError`` (an input cannot be staged: nothing ran, and a
    failed manifest says so at the destination), :class:`JobFailedError` (the work
    failed, after its output and latest checkpoint were returned), and
    :class:`ReturnError` (the destination refused the output, which stays in
    scratch).
    """
    install_log_masking()  # every log line of the run is masked, whoever writes it
    drop_explained_failures()  # an E31 error ends the run in one line, not with the engine's traceback too
    SIGNALLED.clear()
    leaving = None
    try:
        try:
            manifest = _run_job(spec, code_dir)
            RETURNED[str(flow_run.id)] = manifest
            _late_cancel(manifest)
        except JobFailedError as exc:
            RETURNED[str(flow_run.id)] = exc.manifest
            _late_cancel(exc.manifest)
            raise
        except JobBusyError as exc:
            if flow_run.id and exc.holder_run == str(flow_run.id):
                leave_to_first_process(exc)  # never returns: the release below is the first process's
            raise
        finally:  # the output is returned (or cannot be): a run handed over behind this one starts its work
            end_signal_deferral()
            release(str(flow_run.id) if flow_run.id else None)  # (at the latest: the return released it already)
            fence_at_end(str(flow_run.id) if flow_run.id else None)
    except JobBusyError as exc:  # refused, not failed: the job's history shows no failure that never ran
        get_run_logger().warning("%s", scrub(str(exc)))
        return Cancelled(name="Refused", message=f"refused: {scrub(str(exc))}", data=exc)
    except E31Error as exc:  # explained in one line: the flow run fails with it, no traceback in the logs
        get_run_logger().error("%s", scrub(str(exc)))
        return Failed(message=scrub(str(exc)), data=masked_exception(exc))  # a caller gets it raised
    except Exception as exc:  # Prefect makes the state's message of its text: a client's may quote a signed URL
        leaving = masked_exception(exc)
    if leaving is not None:
        raise leaving  # (outside the handler: nothing is chained to it)
    m = Manifest.model_validate(manifest)
    if m.status != "partial" or m.reason == "cancelled":
        return manifest  # (a cancelled run's state is Prefect's: a State returned here would make the call raise)
    return Completed(name="Partial", data=manifest,
                     message=f"partial ({m.reason}): {step_text(m.step)}; {m.message}".rstrip("; "))


def _late_cancel(manifest: dict[str, Any]) -> None:
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


def _run_job(spec: JobSpec, code_dir: str | None) -> dict[str, Any]:
    scheduled = flow_run.scheduled_start_time  # a relative deadline counts from the scheduled start
    plan = compile_plan(spec, start=scheduled if scheduled else None)
    create_markdown_artifact(markdown=describe_markdown(spec, plan), key="job-spec",
                             description=f"{spec.name}: the four declarations")
    check_fits(plan)
    register_destination(spec, plan)
    check_destination(plan.output_url, "output.url")
    if not plan.checkpoint_url.startswith(plan.output_url.rstrip("/") + "/"):
        check_destination(plan.checkpoint_url, "output.checkpoint.url")
    try:
        register_inputs(spec)
    except CredentialError as exc:  # an input that cannot be read: said at the destination, as a missing one is
        write_failure_manifest(_target(plan), str(exc))
        raise
    crashed = open_scratch(plan)
    try:
        try:  # an earlier attempt's undelivered output first, before anything in scratch is cleared
            earlier = deliver_pending(Path(plan.scratch), drop_if_gone=True)
        except Exception as exc:
            if not permanent(exc):
                raise ReturnError(plan, exc) from None
            get_run_logger().warning("an earlier run's output could not be returned and never can be as it is "
                                     "(%s); a failed manifest says so; this run goes on", scrub(str(exc)))
            earlier = None
        if earlier is not None:
            settle_earlier_run(Path(plan.scratch), earlier)
            done = Manifest.model_validate(earlier)
            if done.status == "completed" and done.spec_sha256 == plan.spec_sha256:
                get_run_logger().warning(
                    "the earlier run %s of this same spec had finished; its return was interrupted and is now "
                    "delivered: that is this job's output (the work did not run again)", done.run_id)
                return earlier
        resume = Resume(resume_step(plan), crashed)  # (a fresh start clears the output folder: first)
        # The work's child starts now, importing torch and its entrypoint while the inputs stage.
        prestart(child_config(spec, plan, {}, code_dir), str(plan.run_dir))
        # one reader of this flow run's state (a cancel) for the staging, the wait for the run ahead and the run
        with watching(str(flow_run.id) if flow_run.id else None):
            return _attempt(spec, plan, resume, code_dir)
    finally:
        discard(str(plan.run_dir))  # a child the run did not take (staging failed or was cancelled)
        end_attempt(plan)


def _target(plan: JobPlan) -> ReturnTarget:
    """Where this flow run's output goes, and what it declared."""
    return ReturnTarget(
        job=plan.job, run_id=str(flow_run.id) if flow_run.id else None, output_dir=str(plan.output_dir),
        output_url=plan.output_url, declared=plan.output_files, gpus=plan.gpus, cpus=plan.cpus,
        spec_sha256=plan.spec_sha256, checkpoint_url=plan.checkpoint_url, attempt=attempt_token(),
    )


def _checkpoints(spec: JobSpec, plan: JobPlan, run_id: str | None) -> dict[str, Any]:
    """Where the job's checkpoints go, for a pending record: URL, ``keep``,
    work hash, local folder, unresolved storage options (references only)."""
    return {"url": plan.checkpoint_url, "keep": plan.checkpoint_keep, "work_sha256": plan.work_sha256,
            "dir": str(plan.checkpoint_dir), "run_id": run_id,
            "options": spec.output.checkpoint.storage_options or spec.output.storage_options}


def _too_late(spec: JobSpec, plan: JobPlan, resume: Resume, target: ReturnTarget) -> dict[str, Any] | None:
    """When the run's deadline (less the return reserve and the grace period) leaves no time for its work
    now: a fresh run writes a failed manifest and raises :class:`AdmissionError`; a run an earlier attempt
    began returns what that attempt left (its manifest).  None while there is time.  Checked as the run
    starts and again as its work is about to start (after its staging and any wait behind the job ahead,
    which may overrun, so a work would otherwise start after its deadline less the reserve and be killed at
    once)."""
    now = time.time()
    stop_at, stop_reason = plan.stop_at(now)
    if stop_at - plan.grace_s > now:
        return None
    if not (resume.crashed or resume.step is not None):
        # said at the destination too, so a queued run placed too late for its deadline does not end Failed
        # with no manifest; an earlier complete output stays as it was
        why = _no_time(spec, plan, now, stop_at)
        write_failure_manifest(target, why)
        raise AdmissionError(why)
    # An earlier attempt stopped (or died with its process) and this one has no time left to run.
    earlier = "was lost" if resume.crashed else "stopped early"
    outcome = RunOutcome(reason="crashed" if resume.crashed else stop_reason, exit_code=None, run_s=0.0,
                         checkpoint=latest_durable(plan.checkpoint_url),
                         message=f"an earlier attempt {earlier} and the job can no longer run: "
                                 f"its {stop_reason.replace('_', ' ')}, less the return reserve, has passed")
    return _finish(plan, _return(spec, plan, target, outcome))


def _attempt(spec: JobSpec, plan: JobPlan, resume: Resume, code_dir: str | None) -> dict[str, Any]:
    target = _target(plan)
    late = _too_late(spec, plan, resume, target)
    if late is not None:
        return late
    started = time.monotonic()
    stopped = False
    results: list = []
    with cancel_stops_staging(target.run_id, str(plan.data_dir)), \
            transferring(plan.job):  # a cancel ends the transfers within a chunk; prefetches here pause
        try:
            listings = preflight(plan.inputs, plan.data_dir)  # every input listed, and the space checked, first
            if listings:
                total = sum(x.bytes for x in listings.values())
                files = sum(x.files for x in listings.values())
                get_run_logger().info("data: %d input(s), %d file(s), %d bytes to stage", len(listings), files, total)
            futures = [stage_task.with_options(task_run_name=f"stage-{item.name}").submit(
                           item, str(plan.data_dir), listings[item.name]) for item in plan.inputs]
            results = [f.result() for f in futures]
            staged = {s.name: s.path for s in results}
        except StagingCancelled:
            stopped = True
        except Exception as exc:
            # Nothing ran; say so at the destination, so an older manifest there is not taken for this run's.
            write_failure_manifest(target, str(exc) if isinstance(exc, StageError) else
                                   f"staging failed: {type(exc).__name__}: {scrub(str(exc))}")
            raise
    # staging, and any wait for a prefetch of this job to yield (in open_scratch): resources were held meanwhile
    target.staging_s = time.monotonic() - started + data_wait_s(plan.scratch)
    if results:
        target.staged_before_allocation = not any(s.copied for s in results)
        target.prefetch_s = prefetched_seconds(plan.data_dir, target.run_id) if target.staged_before_allocation else 0.0
    ahead, told = run_ahead(), []
    if ahead and not stopped:  # handed over behind a run on this node: the work starts once that run has ended
        with cancel_stops_staging(target.run_id, str(plan.data_dir)) as watcher, signals_end_wait() as told:
            target.handover_wait_s = wait_for_run_ahead(
                ahead, stop=lambda: watcher.cancelled() or bool(told) or watcher.moved_to() is not None,
                say=get_run_logger().info)
        stopped = watcher.cancelled()
        if target.handover_wait_s > HANDOVER_HELD_S:  # the run ahead still held the node: staged before allocation
            target.handover_staging_s, target.staging_s = target.staging_s, 0.0
            target.staged_before_allocation = True if results else None
    fence(plan, target.run_id)  # placed elsewhere while it staged or waited: the work never starts here
    if told and not stopped and not cancel_requested(target.run_id):  # a drain or Ctrl-C during the wait
        outcome = RunOutcome(reason="signal", exit_code=None, run_s=0.0,
                             message="stopped by a signal while it waited for the job ahead of it on its node; the "
                                     "work did not start")
        return _finish(plan, _return(spec, plan, target, outcome))
    # cancelled while staging: the work never starts (as the reader saw the run last, <= 2 s ago: a cancel since
    # then reaches the work through the run's own watch of the same reader, as a cancel during the run does)
    if stopped or told or cancel_seen(target.run_id):
        when = "it waited for the job ahead of it on its node" if target.handover_wait_s else "the inputs were staged"
        outcome = RunOutcome(reason="cancelled", exit_code=None, run_s=0.0,
                             message=f"cancelled while {when}; the work did not start")
        return _finish(plan, _return(spec, plan, target, outcome))
    late = _too_late(spec, plan, resume, target)
    if late is not None:  # its staging or its wait behind the job ahead took the time its deadline left
        return late
    if ahead:  # its work starts now: a crash from here on uses a retry (work_never_started)
        mark_work_started(target.run_id)
    if resume.step is None:  # a fresh run starts now: an earlier run's durable checkpoints make way
        remove_stale_checkpoints(plan)
    outcome = _run(spec, plan, staged, code_dir, target, time.time())
    return _finish(plan, outcome.manifest or _return(spec, plan, target, outcome))


def _no_time(spec: JobSpec, plan: JobPlan, now: float, stop_at: float) -> str:
    """Why a run cannot start before its deadline, naming the deadline field
    the spec gave, the resolved times (UTC) and the fix."""
    req = spec.request
    field = ("request.deadline_within" if req.deadline_within is not None else
             "request.deadline_at" if req.deadline_at is not None else "request.deadline")

    def utc(seconds: float) -> str:
        return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")

    deadline = plan.deadline.timestamp() if plan.deadline else stop_at
    return (f"{field}: the deadline {utc(deadline)} ({plan.deadline_kind or 'absolute'}) leaves no time to run: the "
            f"work would have to stop by {utc(stop_at)} ({plan.return_reserve_s:g} s before it, to return the output) "
            f"and it is {utc(now)}, with {plan.grace_s:g} s of grace; give a later deadline or start the job sooner")


def _return(spec: JobSpec, plan: JobPlan, target: ReturnTarget, outcome: RunOutcome) -> dict[str, Any]:
    """The return task (retried with backoff); without the Prefect API (it
    may be gone) the same delivery runs in this thread.  The pending record
    exists from before the first byte is sent until the destination
    verified everything (:func:`e31.tasks.pending.recorded_return`), so a
    return cut in any way is finished by ``e31 return JOB`` or the next run.
    A Ctrl-C or SIGTERM during it is noted, not obeyed: the output is on its
    way.  When the destination stays unreachable the output stays in
    scratch with the record; raises :class:`ReturnError`."""
    fence(plan, target.run_id)  # no return from a process whose run is another node's now
    scratch = Path(plan.scratch)
    with signals_deferred(RETURNING_FIRST), \
            transferring(plan.job):  # prefetches on this machine pause meanwhile
        try:
            with recorded_return(scratch, target, outcome, spec.output.storage_options,
                                 _checkpoints(spec, plan, target.run_id)):
                try:
                    if not api_answers():  # a task cannot start without the API: return from here
                        raise ConnectionError("the Prefect API does not answer")
                    manifest = return_task(target, outcome)
                    DELIVERED[plan.job] = manifest
                    hold_signals()
                    return manifest
                except Exception as first:
                    try:
                        manifest = deliver(target, outcome)
                    except Exception as exc:
                        raise (exc if str(exc) else first) from None
                    DELIVERED[plan.job] = manifest  # the job's word is out, whatever the API does next
                    delivered(target.run_id)
                    hold_signals()
                    publish_artifacts(target, manifest)
                    return manifest
        except Exception as cause:
            raise ReturnError(plan, cause) from None


#: Seconds a handed-over run's wait for the run ahead must pass for its staging to count as made before
#: its allocation (the run ahead still held the node when the staging ended): one check of its process.
HANDOVER_HELD_S = 0.1


#: The manifest each job's last run in this process delivered (job name -> manifest): the CLI
#: still reports it, with its exit code, when the Prefect API fails after the output was returned.
DELIVERED: dict[str, dict[str, Any]] = {}


def _finish(plan: JobPlan, manifest: dict[str, Any]) -> dict[str, Any]:
    DELIVERED[plan.job] = manifest
    hold_signals()
    status = Manifest.model_validate(manifest).status
    if status == "completed":
        # Delivered and verified: the next run of this job starts fresh.
        shutil.rmtree(plan.output_dir, ignore_errors=True)
        shutil.rmtree(plan.checkpoint_dir, ignore_errors=True)
    if status == "failed":
        raise JobFailedError(manifest)
    return manifest


def _run(spec: JobSpec, plan: JobPlan, staged: dict[str, str], code_dir: str | None, target: ReturnTarget, now: float) -> RunOutcome:
    """The run task with the spec's retries; a lost child that is not retried
    any more fails the job (with its exit code and the latest checkpoint)."""
    settings = SupervisorConfig(
        job=plan.job,
        child=child_config(spec, plan, staged, code_dir),
        run_dir=str(plan.run_dir),
        checkpoint_url=plan.checkpoint_url,
        keep=plan.checkpoint_keep,
        grace_s=plan.grace_s,
        limit_at=now + plan.limit_s,
        deadline_at=plan.deadline.timestamp() if plan.deadline else None,
        reserve_floor_s=plan.return_reserve_s,
        target=target,
        flow_run_id=target.run_id,
        work_sha256=plan.work_sha256,
        output_options=spec.output.storage_options,
        checkpoints=_checkpoints(spec, plan, target.run_id),
        memory=plan.memory,
    )
    state = run_task.with_options(retries=spec.request.retries, retry_delay_seconds=1)(settings, return_state=True)
    try:
        return state.result()
    except ChildLost as lost:
        lost.outcome.reason = "error"
        return lost.outcome
