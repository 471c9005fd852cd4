"""The ``e31`` worker's ``kill_infrastructure``: Prefect's documented hook
for stopping a flow run's infrastructure, written so that a flow process
returning its output is waited for, not cut.

Prefect 3.9.1 (measured on 3.9.1) calls a worker's ``kill_infrastructure``
in two places:

- ``BaseWorker._cancel_run``: a run cancelled before it started (no start
  time yet) that has an ``infrastructure_pid``.  A flow process this
  worker started is already being cancelled by the worker's runner (its
  cancel sequence, guarded by :mod:`e31.prefect_compat.cancelgate`); this hook
  leaves it to that sequence (``InfrastructureNotAvailable``: Prefect logs
  it and changes nothing, as it did when the process worker had no such
  hook);
- the cancelling-timeout teardown (``CancellingTimeoutTeardownHandler``,
  registered only for a worker type that implements this hook): a run
  still ``Cancelling`` past the server's
  ``PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_CANCELLING_TIMEOUT_SECONDS``
  (300 s), which the server has set ``Cancelled``.  A run whose work had
  ended when the cancel came (tagged
  :data:`e31.tasks.supervisor.marks.WORK_ENDED`) is still returning its
  output then (the cancel gate left it running): its flow process is
  waited for until it ends on its own.  Any other flow process of this
  worker gets SIGTERM (its work stops and returns partial output, as a
  Ctrl-C of ``e31 run`` does), then SIGKILL after ``grace_seconds``.

Only the flow processes this worker started are signalled: the
``infrastructure_pid`` Prefect 3.9.1's worker writes is the bare process id,
which names no machine.

After a flow process ends, a run still ``Cancelling`` whose work had ended
is set from its manifest (:func:`settle_late_cancel`).
"""

from __future__ import annotations

import os
import signal
from typing import Any, Awaitable, Callable

#: Seconds between looks at a flow process that is waited for.
POLL_S = 0.5


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux: its
    ``/proc`` state; elsewhere: a signal 0 answers)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


async def kill_flow_process(infrastructure_pid: str, flows: dict[int, str],
                            read_state_and_tags: Callable[[str], Awaitable[tuple[str | None, Any]]],
                            grace_seconds: float, say: Callable[[str], None]) -> str:
    """Stop the flow process ``infrastructure_pid`` (a process id as text)
    of the run ``flows[pid]`` (``flows``: this worker's flow processes,
    pid -> flow run id), as the module docstring says.
    ``read_state_and_tags(run_id)`` returns the run's state type (e.g.
    ``"CANCELLING"``) and the run itself (for its tags).  ``say``: a line
    for the run's log.  Returns what it did: ``"waited"`` (a return in
    progress, ended on its own), ``"ended"`` (ended within the grace
    period after SIGTERM) or ``"killed"``.

    Raises ``InfrastructureNotAvailable`` for a process this worker did not
    start or a run still ``Cancelling`` (the runner's cancel sequence owns
    it), and ``InfrastructureNotFound`` when the process has already ended."""
    import anyio
    from prefect.exceptions import InfrastructureNotAvailable, InfrastructureNotFound

    from e31.tasks.supervisor.marks import work_ended_at

    try:
        pid = int(str(infrastructure_pid).rpartition(":")[2])
    except ValueError:
        raise InfrastructureNotAvailable(f"infrastructure_pid {infrastructure_pid!r} is not a process id") from None
    run_id = flows.get(pid)
    if run_id is None:
        raise InfrastructureNotAvailable(f"process {pid} is not a flow process this e31 worker started")
    if not _alive(pid):
        raise InfrastructureNotFound(f"flow process {pid} has ended")
    state, run = await read_state_and_tags(run_id)
    if state == "CANCELLING":
        raise InfrastructureNotAvailable(f"flow process {pid} is being cancelled by the worker's runner")
    if work_ended_at(run) is not None:
        say(f"flow process {pid} is returning the run's output (its work ended before the cancel): waited for, "
            "not killed")
        while _alive(pid):
            await anyio.sleep(POLL_S)
        return "waited"
    os.kill(pid, signal.SIGTERM)
    with anyio.move_on_after(grace_seconds):
        while _alive(pid):
            await anyio.sleep(POLL_S)
        return "ended"
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return "ended"
    return "killed"


def settle_late_cancel(flow_run: Any) -> bool:
    """After the flow process of ``flow_run`` (a Prefect ``FlowRun``) ended:
    a run still ``Cancelling`` whose work had ended (tagged
    :data:`e31.tasks.supervisor.marks.WORK_ENDED`) is set to the state of
    the manifest it wrote (read at its destination:
    :func:`e31.flows.cancelhook.returned_by`), when that manifest is not a
    cancel's.  Returns whether it set one; never raises (a destination the
    worker cannot read leaves the run to ``end_cancelling``)."""
    from prefect.client.orchestration import get_client

    from e31.flows.cancelhook import keep_manifest_state, returned_by, stopped_by_cancel
    from e31.tasks.manifest_model import ManifestHead
    from e31.tasks.supervisor.marks import work_ended_at

    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run.id)
        if run.state is None or not run.state.is_cancelling() or work_ended_at(run) is None:
            return False
        manifest = returned_by(run)
        if not isinstance(manifest, dict) or ManifestHead.of(manifest).status == "returning" or \
                stopped_by_cancel(manifest):
            return False
        return keep_manifest_state(str(run.id), manifest)
    except Exception:
        return False
