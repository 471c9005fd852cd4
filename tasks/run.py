"""The ``run`` task: run the work in a supervised child process.

The supervisor loop (:mod:`e31.tasks.supervisor.loop`) owns the clock and the
signals; the task returns a :class:`~e31.tasks.outcome.RunOutcome` instead of
raising, so the return step always runs; after a cancel it returns the
output itself, because Prefect starts no new task in a cancelling flow run.
A child lost to a SIGKILL that E31 did not send raises
:class:`~e31.tasks.outcome.ChildLost`, which Prefect retries
(``request.retries``) from the newest checkpoint.
"""

from __future__ import annotations

from prefect import task

from e31.tasks.outcome import ChildLost, RunOutcome
from e31.tasks.retrying import retry_only
from e31.tasks.supervisor.loop import SupervisorConfig, supervise
from e31.tasks.storage.masked_errors import masks_failures

__all__ = ["SupervisorConfig", "run_task", "supervise"]


#: Retry only a lost child; never the work's own failure or a bad spec.
_lost_retry = retry_only(ChildLost)


@task(name="run", task_run_name="run", retry_condition_fn=_lost_retry)
@masks_failures
def run_task(settings: SupervisorConfig) -> RunOutcome:
    """Run the work to the end or to its stop; see the module docstring.
    Returns a :class:`RunOutcome`; raises :class:`ChildLost` for a lost child."""
    outcome = supervise(settings)
    if outcome.reason == "crashed":
        raise ChildLost(outcome)
    return outcome
