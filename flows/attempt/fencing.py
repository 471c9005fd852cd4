"""This flow process's attempt at its run: the token its manifests carry,
fencing (it stops, writing nothing more, once its run is placed on another
node: :mod:`e31.tasks.supervisor.fence`), and a second start of a run that
a first flow process still runs on this machine."""

from __future__ import annotations

import os
import sys

from prefect.runtime import flow_run

from e31.flows.compile import JobPlan
from e31.flows.resume import JobBusyError
from e31.tasks.supervisor.cancel import moved_to
from e31.tasks.supervisor.fence import ENDED_MARK, lift_fence, moved_now, step_aside
from e31.tasks.supervisor.warm import discard


_ATTEMPT: dict[int, str] = {}  # pid -> this flow process's attempt token (made in the process: forks differ)


def attempt_token() -> str:
    """A token of this flow process's attempt at its run: its node (or
    host), pid and 8 random hex digits, made once per process."""
    import socket
    import uuid

    pid = os.getpid()
    if pid not in _ATTEMPT:
        _ATTEMPT[pid] = f"{os.environ.get('E31_NODE') or socket.gethostname()}-{pid}-{uuid.uuid4().hex[:8]}"
    return _ATTEMPT[pid]


def leave_to_first_process(exc: JobBusyError) -> None:
    """This flow process is a second start of a flow run whose first flow
    process still runs it on this machine (it holds the job's lock): the
    run's node was taken for lost while its worker was down past the lease,
    and the run was queued again and placed back here.  Any state this
    process ended the run with (``Refused`` was one) would reach the first
    process, which stops its work on a cancel: so it ends at once, with
    exit status 0 and no state written (Prefect's worker then writes
    none either), and the first process finishes the run and returns its
    output.  Never returns."""
    print(f"e31: flow run {flow_run.id} is still run by its first flow process on this machine (pid "
          f"{exc.holder_pid}); this second start of it ends here and leaves the run to that one", file=sys.stderr,
          flush=True)
    os._exit(0)


def fence_at_end(run_id: str | None) -> None:
    """Before the engine writes this run's final state: one read of the run
    (on a queue only) and, when it was placed on another node meanwhile
    (its return was under way when that happened), end this process
    without writing it (:func:`e31.tasks.supervisor.fence.step_aside`):
    the run is the other attempt's, whose resources a final state would
    free while its work runs.  A run found crashed or ended meanwhile (its
    node taken for lost as its work ended) has its fence lifted, its work
    being over (:func:`e31.tasks.supervisor.fence.lift_fence`), and the
    engine writes its state as before.  Returns otherwise."""
    moved = moved_now(run_id)
    if moved is not None and moved.startswith(ENDED_MARK):
        lift_fence(run_id)
    elif moved is not None:
        step_aside(run_id, moved)


def fence(plan: JobPlan, run_id: str | None) -> None:
    """When this run was seen placed on another node (its node was taken for
    lost meanwhile; :mod:`e31.tasks.supervisor.fence`), end this flow
    process now, writing nothing more: the prestarted child of the work is
    discarded first.  Returns otherwise."""
    moved = moved_to(run_id)
    if moved is not None:
        discard(str(plan.run_dir))
        step_aside(run_id, moved)
