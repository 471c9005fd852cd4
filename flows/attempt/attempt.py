"""One attempt at one run of a job, step by step (:class:`Step`).

The attempt owns the run's life in this flow process: it admits the spec,
opens the job's scratch folder, delivers an earlier attempt's pending
return, stages the inputs, passes its gates (:mod:`e31.flows.attempt.gates`),
runs the supervised work, returns the output through the one delivery
path (:func:`e31.tasks.returning.return_output`) and settles.  Each step
is logged (``attempt step: <step>``) and kept in :attr:`Attempt.step`.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from e31.flows.admission import check_fits
from e31.flows.attempt.errors import JobFailedError, ReturnError
from e31.flows.attempt.fencing import attempt_token, fence
from e31.flows.attempt.gates import GATES, Gate, RunGates, time_left
from e31.flows.attempt.steplabel import StepLabel
from e31.flows.attempt.steps import Step
from e31.flows.compile import JobPlan, compile_plan, describe_markdown
from e31.flows.exitsignals import hold_signals
from e31.flows.gang.lead import lead_rendezvous, placed_nodes
from e31.flows.queue.handover import release, run_ahead
from e31.flows.resume import Resume, end_attempt, open_scratch, remove_stale_checkpoints, resume_step
from e31.flows.workconfig import child_config
from e31.prefect_compat.statesync import settle_earlier_run
from e31.specs import JobSpec
from e31.tasks.deliver import ReturnTarget, check_destination, write_failure_manifest
from e31.tasks.manifest_model import Manifest
from e31.tasks.outcome import ChildLost, RunOutcome
from e31.tasks.placement_record import PlacementRecord
from e31.tasks.pending import deliver_pending, permanent
from e31.tasks.returning import return_output
from e31.tasks.run import SupervisorConfig, run_task
from e31.tasks.stage import StageError, StagingCancelled, preflight, stage_task
from e31.tasks.storage import scrub
from e31.tasks.storage.credentials import CredentialError
from e31.tasks.storage.options import register_destination, register_inputs
from e31.tasks.storage.scratch_cache import data_wait_s, prefetched_seconds
from e31.tasks.storage.transfer_markers import transferring
from e31.tasks.supervisor.cancel import cancel_stops_staging, watching
from e31.tasks.supervisor.marks import mark_work_started
from e31.tasks.supervisor.warm import discard, prestart


#: The manifest each job's last run in this process delivered (job name -> manifest): the CLI
#: still reports it, with its exit code, when the Prefect API fails after the output was returned.
DELIVERED: dict[str, dict[str, Any]] = {}

#: Called with a flow run's id (or None) as soon as its output is returned (the manifest written and
#: verified), before its artifacts: by default the release of the run handed over behind it
#: (:func:`e31.flows.queue.handover.release`), whose work then starts while this process finishes.
ON_DELIVERED: list[Callable[[str | None], None]] = [release]


class Attempt:
    """One attempt at the run of ``spec`` in this flow process.

    ``code_dir``: a folder put first on the work's ``sys.path``.
    ``gates``: what must hold before the work starts (default
    :data:`e31.flows.attempt.gates.GATES`).  :meth:`run` takes the steps
    and returns the manifest (a dict, docs/manifest.md)."""

    def __init__(self, spec: JobSpec, code_dir: str | None = None, gates: tuple[Gate, ...] = GATES):
        self.spec, self.code_dir, self.gates = spec, code_dir, gates
        self.step: Step | None = None
        self.run_id: str | None = str(flow_run.id) if flow_run.id else None
        self.plan: JobPlan | None = None
        self.target: ReturnTarget | None = None
        self.resume: Resume | None = None
        self.staged: dict[str, str] = {}
        self.staged_any = False  # (an input was staged: the manifest says whether before the allocation)
        self.staging_cancelled = False
        self.label = StepLabel(self.run_id)

    def run(self) -> dict[str, Any]:
        """Take every step and return the manifest.  Raises what
        :func:`e31.flows.job.run_job` documents."""
        self.admit()
        self.enter(Step.SCRATCH)
        crashed = open_scratch(self.plan)
        try:
            earlier = self.deliver_pending()
            if earlier is not None:
                return earlier
            self.resume = Resume(resume_step(self.plan), crashed)  # (a fresh start clears the output folder: first)
            # The work's child starts now, importing torch and its entrypoint while the inputs stage.
            prestart(child_config(self.spec, self.plan, {}, self.code_dir), str(self.plan.run_dir))
            # one reader of this flow run's state (a cancel) for the staging, the gates and the run
            with watching(self.run_id):
                self.target = self.return_target()
                outcome = time_left(self)
                if outcome is None:
                    self.stage()
                    outcome = self.pass_gates()
                if outcome is None:
                    outcome = self.run_work()
                manifest = outcome.manifest or self.return_output(outcome)
                return self.settle(manifest)
        finally:
            discard(str(self.plan.run_dir))  # a child the run did not take (staging failed or was cancelled)
            end_attempt(self.plan)

    def enter(self, step: Step) -> None:
        """Make ``step`` the attempt's current step, log it, and show it on
        the flow run (:mod:`e31.flows.attempt.steplabel`)."""
        self.step = step
        get_run_logger().debug("attempt step: %s", step.value)
        self.label.show(step)

    def admit(self) -> None:
        """Compile the spec (a relative deadline counts from the flow run's
        scheduled start), show it as the ``job-spec`` artifact, check the
        request fits this machine and that both destinations are writable,
        and register the storage options.  Raises
        :class:`e31.flows.admission.AdmissionError`,
        :class:`e31.tasks.deliver.DestinationError` and
        :class:`e31.tasks.storage.credentials.CredentialError` (a failed
        manifest says the last at the destination)."""
        self.enter(Step.ADMIT)
        spec = self.spec
        scheduled = flow_run.scheduled_start_time
        plan = self.plan = compile_plan(spec, start=scheduled if scheduled else None)
        create_markdown_artifact(markdown=describe_markdown(spec, plan), key="job-spec",
                                 description=f"{spec.name}: the four declarations")
        check_fits(plan, placed_nodes=placed_nodes(self.placement()))
        register_destination(spec, plan)
        check_destination(plan.output_url, "output.url")
        if not plan.checkpoint_url.startswith(plan.output_url.rstrip("/") + "/"):
            check_destination(plan.checkpoint_url, "output.checkpoint.url")
        try:
            register_inputs(spec)
        except CredentialError as exc:  # an input that cannot be read: said at the destination, as a missing one is
            write_failure_manifest(self.return_target(), str(exc))
            raise

    def deliver_pending(self) -> dict[str, Any] | None:
        """Return an earlier attempt's undelivered output first, before
        anything in scratch is cleared.  Returns its manifest when that
        attempt had completed this same spec (the work does not run again),
        else None.  Raises :class:`ReturnError` when the destination cannot
        take it now."""
        self.enter(Step.DELIVER_PENDING)
        plan = self.plan
        try:
            earlier = deliver_pending(Path(plan.scratch), drop_if_gone=True)
        except Exception as exc:
            if not permanent(exc):
                raise ReturnError(plan, exc) from None
            get_run_logger().warning("an earlier run's output could not be returned and never can be as it is "
                                     "(%s); a failed manifest says so; this run goes on", scrub(str(exc)))
            return None
        if earlier is None:
            return None
        settle_earlier_run(Path(plan.scratch), earlier)
        done = Manifest.model_validate(earlier)
        if done.status == "completed" and done.spec_sha256 == plan.spec_sha256:
            get_run_logger().warning(
                "the earlier run %s of this same spec had finished; its return was interrupted and is now "
                "delivered: that is this job's output (the work did not run again)", done.run_id)
            return earlier
        return None

    def return_target(self) -> ReturnTarget:
        """Where this flow run's output goes, and what it declared."""
        plan = self.plan
        return ReturnTarget(
            job=plan.job, run_id=self.run_id, output_dir=str(plan.output_dir),
            output_url=plan.output_url, declared=plan.output_files,
            gpus=plan.gpus * plan.nodes, cpus=plan.cpus * plan.nodes,  # the meter bills every node of a gang
            spec_sha256=plan.spec_sha256, checkpoint_url=plan.checkpoint_url, attempt=attempt_token(),
            tenant=self.tenant(), **self.preempted_before(),
        )

    def tenant(self) -> str | None:
        """The pool's tenant this flow run is for (its tag ``tenant:NAME``), or None: not a run of a queue."""
        from prefect.runtime import flow_run

        from e31.flows.queue.tenancy import TENANT_TAG, tenant_of

        try:
            tags = list(flow_run.tags or [])
        except Exception:  # not in a flow run
            return None
        return tenant_of(tags) if any(str(t).startswith(TENANT_TAG) for t in tags) else None

    def placement(self) -> PlacementRecord:
        """This flow run's ``placement`` parameter, typed (empty outside a queue)."""
        try:
            return PlacementRecord.from_parameter((flow_run.parameters or {}).get("placement"))
        except Exception:  # not in a flow run
            return PlacementRecord()

    def run_count(self) -> int:
        """Prefect's ``run_count`` of this flow run as its runtime has it (1 outside a flow run): read as the
        flow run started, before it entered ``Running``, so one less than the server's from the second attempt
        on."""
        try:
            return int(flow_run.run_count or 1)
        except Exception:  # not in a flow run
            return 1

    def preempted_before(self) -> dict[str, Any]:
        """The queue's earlier preemptions of this flow run and the seconds of work they threw away, as its
        ``placement`` parameter records them (:class:`e31.tasks.placement_record.PlacementRecord`); none
        outside a queue."""
        try:
            record = PlacementRecord.from_parameter((flow_run.parameters or {}).get("placement"))
        except Exception:  # not in a flow run
            return {}
        return {"preemptions": len(record.preempted), "lost_s": record.lost_s}

    def checkpoints(self) -> dict[str, Any]:
        """Where the job's checkpoints go, for a pending record: URL, ``keep``,
        work hash, local folder, unresolved storage options (references only)."""
        spec, plan = self.spec, self.plan
        return {"url": plan.checkpoint_url, "keep": plan.checkpoint_keep, "work_sha256": plan.work_sha256,
                "dir": str(plan.checkpoint_dir), "run_id": self.run_id,
                "options": spec.output.checkpoint.storage_options or spec.output.storage_options}

    def stage(self) -> None:
        """Copy every input to scratch (one ``stage`` task per input,
        concurrent) after listing them all and checking the space.  A
        cancel ends the transfers within a chunk (the gates then return
        ``cancelled``).  Any other failure writes a failed manifest (so an
        older one at the destination is not taken for this run's) and is
        raised."""
        self.enter(Step.STAGE)
        plan, target = self.plan, self.target
        started = time.monotonic()
        results: list = []
        with cancel_stops_staging(target.run_id, str(plan.data_dir)), \
                transferring(plan.job):  # prefetches here pause
            try:
                listings = preflight(plan.inputs, plan.data_dir)  # every input listed, and the space checked, first
                if listings:
                    total = sum(x.bytes for x in listings.values())
                    files = sum(x.files for x in listings.values())
                    get_run_logger().info("data: %d input(s), %d file(s), %d bytes to stage", len(listings), files,
                                          total)
                futures = [stage_task.with_options(task_run_name=f"stage-{item.name}").submit(
                               item, str(plan.data_dir), listings[item.name]) for item in plan.inputs]
                results = [f.result() for f in futures]
                self.staged = {s.name: s.path for s in results}
            except StagingCancelled:
                self.staging_cancelled = True
            except Exception as exc:
                write_failure_manifest(target, str(exc) if isinstance(exc, StageError) else
                                       f"staging failed: {type(exc).__name__}: {scrub(str(exc))}")
                raise
        # staging, and any wait for a prefetch of this job to yield (in open_scratch): resources were held meanwhile
        target.staging_s = time.monotonic() - started + data_wait_s(plan.scratch)
        if results:
            self.staged_any = True
            target.staged_before_allocation = not any(s.copied for s in results)
            target.prefetch_s = prefetched_seconds(plan.data_dir, target.run_id) \
                if target.staged_before_allocation else 0.0

    def pass_gates(self) -> RunOutcome | None:
        """Take the gates in order; the first outcome one answers is the
        attempt's (its work does not start), None when all pass."""
        self.enter(Step.GATES)
        for gate in self.gates:
            outcome = gate(self)
            if outcome is not None:
                return outcome
        return None

    def run_work(self) -> RunOutcome:
        """The run task with the spec's retries; a lost child that is not
        retried any more is the outcome ``error`` (with its exit code and
        the latest checkpoint)."""
        self.enter(Step.RUN)
        spec, plan, target = self.spec, self.plan, self.target
        if run_ahead():  # its work starts now: a crash from here on uses a retry (work_never_started)
            mark_work_started(target.run_id)
        if self.resume.step is None:  # a fresh run starts now: an earlier run's durable checkpoints make way
            remove_stale_checkpoints(plan)
        now = time.time()
        settings = SupervisorConfig(
            job=plan.job,
            child=child_config(spec, plan, self.staged, self.code_dir),
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
            checkpoints=self.checkpoints(),
            memory=plan.memory,
            watch=RunGates,
            rendezvous=lead_rendezvous(self.placement(), target.run_id, self.run_count(), plan.stop_at(now)[0],
                                       plan.grace_s),
        )
        state = run_task.with_options(retries=spec.request.retries, retry_delay_seconds=1)(settings, return_state=True)
        try:
            return state.result()
        except ChildLost as lost:
            lost.outcome.reason = "error"
            return lost.outcome

    def return_output(self, outcome: RunOutcome) -> dict[str, Any]:
        """Deliver ``outcome``'s output through the ``return`` task (retried
        with backoff; in this thread when the Prefect API is gone), with a
        pending record from before the first byte until the destination
        verified everything, so a return cut in any way is finished by
        ``e31 return JOB`` or the next run.  A Ctrl-C or SIGTERM meanwhile
        is noted, not obeyed.  Raises :class:`ReturnError` (the output stays
        in scratch with the record)."""
        self.enter(Step.RETURN)
        plan, target = self.plan, self.target
        fence(plan, target.run_id)  # no return from a process whose run is another node's now

        def told(manifest: dict[str, Any]) -> None:
            DELIVERED[plan.job] = manifest  # the job's word is out, whatever the API does next
            for hook in list(ON_DELIVERED):
                try:
                    hook(target.run_id)
                except Exception:
                    pass

        with transferring(plan.job):  # prefetches on this machine pause meanwhile
            try:
                manifest = return_output(Path(plan.scratch), target, outcome,
                                         output_options=self.spec.output.storage_options,
                                         checkpoints=self.checkpoints(), as_task=True, on_delivered=told)
            except Exception as cause:
                raise ReturnError(plan, cause) from None
        return manifest

    def settle(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """The attempt's end: the manifest kept for the CLI, late signals
        held (the output is out), scratch cleared after a complete output
        (the next run starts fresh); a ``failed`` one raises
        :class:`JobFailedError`."""
        self.enter(Step.SETTLE)
        plan = self.plan
        DELIVERED[plan.job] = manifest
        hold_signals()
        status = Manifest.model_validate(manifest).status
        if status == "completed":
            shutil.rmtree(plan.output_dir, ignore_errors=True)
            shutil.rmtree(plan.checkpoint_dir, ignore_errors=True)
        if status == "failed":
            raise JobFailedError(manifest)
        return manifest
