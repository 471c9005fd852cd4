"""The one delivery path: every return of an output goes through
:func:`return_output`.

Its callers: an attempt's return step (through the retried ``return`` task
while the Prefect API answers, in the flow's own thread when it does not),
the return a cancel makes from inside the run task
(:mod:`e31.tasks.supervisor.loop`), and the delivery of a return an earlier
attempt could not finish (:func:`e31.tasks.pending.deliver_pending`:
``e31 return JOB``, the next run of the job, a worker finishing a cut
return).  Each gets the same guarantees:

- the pending record is written before the first byte goes out and removed
  only once the destination verified everything
  (:func:`e31.tasks.pending.recorded_return`), so a return cut in any way
  can be finished later;
- a SIGTERM or SIGINT during it is noted, not obeyed;
- a return that can never succeed as it is leaves a failed manifest in
  ``partial/`` and drops the record;
- once the manifest is written, ``on_delivered`` is told (an attempt starts
  the run handed over behind it then), before the manifest artifacts, which
  are best effort.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from e31.prefect_compat.api import api_answers
from e31.tasks.deliver import (RETURN_BACKOFF_S, RETURN_RETRIES, DestinationError, ReturnTarget, deliver,
                               publish_artifacts)
from e31.tasks.outcome import RunOutcome
from e31.tasks.pending import RETURNING_FIRST, recorded_return
from e31.tasks.retrying import retry_unless
from e31.tasks.storage.masked_errors import masks_failures
from e31.tasks.supervisor.process import signals_deferred

#: Told once a return's manifest is written and verified, with that manifest (a dict).
Delivered = Callable[[dict[str, Any]], None]


def return_output(scratch: Path, target: ReturnTarget, outcome: RunOutcome, *,
                  output_options: dict[str, Any] | None = None, checkpoints: dict[str, Any] | None = None,
                  as_task: bool = False, on_delivered: Delivered | None = None,
                  artifacts: bool = True) -> dict[str, Any]:
    """Return ``outcome``'s output (``target.output_dir``) to
    ``target.output_url`` and return the manifest written there (a dict,
    docs/manifest.md).

    ``scratch``: the job's scratch folder, where the pending record lives
    for as long as the return is under way or failed.  ``output_options``,
    ``checkpoints``: what the record keeps for a later delivery (secret
    references only, never values; :func:`e31.tasks.pending.save_pending`).
    ``as_task``: deliver through the ``return`` Prefect task (retried with
    backoff, shown in the UI) when the API answers, else, and when the task
    fails, once more in this thread (the API may be gone while the store
    answers).  ``on_delivered``: called with the manifest as soon as it is
    written, before the artifacts; an exception it raises is ignored.
    ``artifacts``: publish the manifest table and output link in the
    Prefect UI (False outside a flow run: ``e31 return``).

    Raises what the delivery raises, the record kept (its ``error`` says
    why) unless no later try can succeed (:func:`e31.tasks.pending.permanent`:
    a failed manifest says so in ``partial/`` and the record is dropped).
    """
    with signals_deferred(RETURNING_FIRST), recorded_return(scratch, target, outcome, output_options, checkpoints):
        if not as_task:
            return _deliver(target, outcome, on_delivered, artifacts)
        try:
            if not api_answers():  # a task cannot start without the API: deliver from here
                raise ConnectionError("the Prefect API does not answer")
            return return_task(target, outcome, on_delivered)
        except Exception as first:
            try:
                return _deliver(target, outcome, on_delivered, artifacts)
            except Exception as exc:
                raise (exc if str(exc) else first) from None


def _deliver(target: ReturnTarget, outcome: RunOutcome, on_delivered: Delivered | None,
             artifacts: bool) -> dict[str, Any]:
    """One delivery: the files and manifest, then ``on_delivered``, then the artifacts."""
    manifest = deliver(target, outcome)
    if on_delivered is not None:
        try:
            on_delivered(manifest)
        except Exception:
            pass
    if artifacts:
        publish_artifacts(target, manifest)
    return manifest


@task(name="return", task_run_name="return", retries=RETURN_RETRIES,
      retry_delay_seconds=exponential_backoff(backoff_factor=RETURN_BACKOFF_S), retry_jitter_factor=0.5,
      retry_condition_fn=retry_unless(DestinationError), cache_policy=NO_CACHE)
@masks_failures
def return_task(req: ReturnTarget, outcome: RunOutcome, on_delivered: Delivered | None = None) -> dict[str, Any]:
    """The Prefect task of a delivery (:func:`return_output`), retried with
    exponential backoff after store errors (``E31_TRANSFER_RETRIES``,
    default 3; first delay ``E31_TRANSFER_BACKOFF_S``, default 2 s,
    doubling), never after a :class:`e31.tasks.deliver.DestinationError`;
    adds a table artifact of the returned files and the job's status."""
    return _deliver(req, outcome, on_delivered, True)
