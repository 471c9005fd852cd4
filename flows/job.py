"""``run_job``: the one static Prefect flow every E31 job runs as.

stage (one task per input, concurrent) -> run (supervised child process,
submitting a checkpoint task per durable checkpoint) -> return (output and
manifest), as one attempt (:mod:`e31.flows.attempt`) takes its steps.
Usable from Python (``run_job(load_spec("x.yaml"))`` returns the manifest),
from the ``e31`` CLI, and as a deployment entrypoint
(``flows/job.py:run_job``).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from e31.flows.attempt import JobFailedError, ReturnError, run_in_flow
from e31.flows.cancelhook import settle_cancelled
from e31.flows.deploy import FLOW_NAME
from e31.specs import JobSpec

__all__ = ["JobFailedError", "ReturnError", "run_job"]


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
    failed manifest says so at the destination), :class:`e31.flows.attempt.JobFailedError` (the work
    failed, after its output and latest checkpoint were returned), and
    :class:`e31.flows.attempt.ReturnError` (the destination refused the output, which stays in
    scratch).
    """
    return run_in_flow(spec, code_dir)
