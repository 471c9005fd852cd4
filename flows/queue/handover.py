"""A handed-over run's wait for the run ahead of it on its node.

The scheduler hands a node's resources over to the next run planned on
them shortly before the running job's planned end
(:data:`e31.flows.queue.mapping.HANDOVER_S`): the next run is released at
once with ``e31_after`` in its ``placement`` naming the run ahead, and its
worker gives the flow process ``E31_AFTER``.  The flow process starts,
stages its inputs, then waits here until the run ahead has ended (its flow
process is gone from this machine, or its flow run is final) before its
work starts: the Prefect lifecycle of the next run (its flow process,
states, task runs) and its staging overlap the end of the run ahead, and
the work of the two never overlaps.

Both runs are placed on the same node, so the run ahead's flow process is
on this machine.  The wait ends at the first of:

- the run ahead's own word: the waiting run leaves a marker file named
  after it in :func:`handover_dir` (the node's scratch root), and every run
  removes the marker of its own id once its output is returned
  (:func:`release`, at the end of ``run_job``), before its flow process
  goes through Prefect's shutdown (sending its last logs and events);
- its flow process is gone (its pid, Prefect's ``infrastructure_pid``,
  checked every :data:`POLL_S` seconds: a killed run);
- its flow run is final (read every :data:`API_EVERY_S` seconds: a run
  whose process this machine cannot see; every :data:`API_ALIVE_EVERY_S`
  seconds once its flow process is seen alive here, since the marker and
  the process check then end the wait without the API).

A run ahead whose flow process died during the return of its output has
not ended with its process: the node's e31 worker finishes that return
(:mod:`e31.deployments.cutreturn`), and the wait goes on until it has
(:func:`cut_return_ahead`).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable

#: The environment variable a handed-over run's flow process gets: the flow run id of the run ahead.
AFTER_ENV = "E31_AFTER"
#: Seconds between checks of the run ahead's flow process (a look in /proc).
POLL_S = 0.05
#: Seconds between reads of the run ahead's flow run from the Prefect API.
API_EVERY_S = 2.0
#: Seconds between those reads once the run ahead's flow process was seen alive on this machine: each read is a
#: request the Prefect server answers for every waiting run (with 1,000 short jobs, ~2 per job at 2 s).
API_ALIVE_EVERY_S = 10.0
#: Seconds between those reads while the run ahead's worker finishes its cut return (:func:`cut_return_ahead`).
RETURNING_READ_S = 0.5


def flow_process_alive(run: Any) -> bool:
    """Whether the flow process of ``run`` (a Prefect ``FlowRun``) runs on
    this machine: its ``infrastructure_pid`` (the pid Prefect's process
    worker recorded) is a live process whose environment names this flow
    run (``PREFECT__FLOW_RUN_ID``), so a pid reused by another process does
    not count.  A run with no pid yet (the worker died while submitting it)
    has none.  A zombie (killed, not reaped) is gone.  An empty environment
    (a process still in ``execve``) is read again for up to 0.2 s.  A process whose
    environment cannot be read (another user's) counts as alive, and so does
    any on a system without ``/proc``."""
    pid = str(run.infrastructure_pid or "").rsplit(":", 1)[-1]
    if not pid.isdigit():
        return False
    if not Path("/proc/self/environ").exists():  # no /proc (not Linux): cannot tell, so not gone
        return True
    for _ in range(10):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except (FileNotFoundError, ProcessLookupError):  # gone; or a zombie (ESRCH): killed, its dead parent's
            return False  # child not reaped yet by PID 1 (a container's init may never reap it)
        except OSError:  # not ours to read: do not take what may be running for gone
            return True
        if environ:
            break
        # Empty: a process in the middle of exec (its new memory has no environment yet, for a moment after
        # the parent's Popen returned) or a kernel thread that took the pid.  Read again shortly.
        time.sleep(0.02)
    return f"PREFECT__FLOW_RUN_ID={run.id}".encode() in environ.split(b"\0")


def leftover_work(run_id: str) -> list[int]:
    """The pids of live processes of the flow run ``run_id``'s work: those
    whose environment has both ``PREFECT__FLOW_RUN_ID=<run_id>`` (every
    process its flow process starts inherits it) and an ``E31_WORK_TOKEN``
    (the work's own processes, :class:`e31.tasks.supervisor.process.WorkTree`;
    not the flow process).  Once its flow process is gone (kill -9), such a
    process is an orphan still using the run's devices.  Only this node's
    (``E31_NODE``, when set: a machine may hold several declared nodes).
    Linux only ([] elsewhere)."""
    from e31.tasks.supervisor.fence import this_node
    from e31.tasks.supervisor.process import TOKEN_VAR, processes_where

    run_mark, token = f"PREFECT__FLOW_RUN_ID={run_id}".encode(), f"{TOKEN_VAR}=".encode()
    node = this_node()
    here = f"E31_NODE={node}".encode() if node else None  # several nodes on one machine: only this node's
    return processes_where(lambda environ: run_mark in environ and any(e.startswith(token) for e in environ)
                           and (here is None or here in environ))


def end_leftover_work(run_id: str, wait_s: float = 10.0) -> list[int]:
    """SIGKILL the processes of ``run_id``'s work left after its flow
    process ended (:func:`leftover_work`) and wait up to ``wait_s`` seconds
    for them to be gone: the devices of an ended run are free only once its
    work is.  Returns the pids killed."""
    from e31.tasks.supervisor.process import sigkill_each

    killed: list[int] = []
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        pids = leftover_work(run_id)
        if not pids:
            break
        killed += sigkill_each(pids)
        time.sleep(POLL_S)
    return sorted(set(killed))


def handover_dir() -> Path:
    """``$E31_SCRATCH/.handover`` (the node's scratch root, shared by the
    flow processes of one worker): the markers of runs waited for."""
    from e31.flows.compile import default_scratch_root

    return Path(default_scratch_root()) / ".handover"


def release(run_id: str | None) -> None:
    """Say that the run ``run_id`` has returned its output: remove its
    marker, so a run handed over behind it starts its work now.  Best
    effort (a run without a marker has nobody waiting)."""
    if run_id:
        try:
            (handover_dir() / str(run_id)).unlink(missing_ok=True)
        except OSError:
            pass


@contextlib.contextmanager
def signals_end_wait() -> Any:
    """Within the block, SIGTERM and SIGINT (a worker's drain, a cancel's
    kill, Ctrl-C) are noted in the list it yields instead of ending the
    process, so a run waiting for the run ahead ends with its manifest; the
    previous handlers come back after.  A no-op outside the main thread."""
    import signal
    import threading

    told: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield told
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: told.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield told
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_ahead() -> str | None:
    """The flow run id this process's run was handed over behind
    (``E31_AFTER``), or None."""
    return os.environ.get(AFTER_ENV) or None


def requeued(state: Any) -> bool:
    """Whether the run ahead, in ``state``, is back in the queue instead of
    on this node (``Scheduled`` not named ``Placed``: a run handed over
    behind one only placed, which crashed before it started and was queued
    again): it will not run here first, so the wait is over."""
    from e31.flows.queue.mapping import PLACED

    return state.type.value == "SCHEDULED" and state.name != PLACED


def fresh_crash(state: Any) -> bool:
    """Whether ``state`` is a ``Crashed`` younger than
    :data:`e31.flows.queue.mapping.SETTLE_S`: Prefect's worker writes it
    for a flow process that exited non-zero a moment before the e31 worker
    holds a run whose return was cut ``Pending`` (``Returning``)."""
    from e31.flows.queue.mapping import SETTLE_S

    if state.type.value != "CRASHED":
        return False
    from e31.prefect_compat.clock import server_now

    now = server_now()  # the state's timestamp is the server's
    stamp = state.timestamp.timestamp() if state.timestamp is not None else now
    return now - stamp < SETTLE_S


def cut_return_ahead(run: Any) -> bool:
    """Whether the run ahead (a Prefect ``FlowRun``, or None when never
    read) left a cut return in this node's scratch
    (:func:`e31.tasks.pending.cut_return_of` of ``$E31_SCRATCH/<its job>``):
    its flow process died while returning its output, and the node's e31
    worker is delivering it (:mod:`e31.deployments.cutreturn`).  The
    node's resources stay the run ahead's until that ends."""
    from e31.flows.compile import default_scratch_root
    from e31.tasks.pending import cut_return_of

    spec = (getattr(run, "parameters", None) or {}).get("spec")
    job = spec.get("name") if isinstance(spec, dict) else None
    if not isinstance(job, str) or not job or "/" in job or job.startswith("."):
        return False
    return cut_return_of(default_scratch_root() / job, str(run.id))


def _this_node() -> str | None:
    from e31.tasks.supervisor.fence import this_node

    return this_node()


def attempt_over(run: Any, me: str | None, node: str | None) -> str | None:
    """Why the attempt of the run ahead, ``run`` (a Prefect flow run), that the run ``me`` waits for has
    ended although ``run`` is alive: its placement now hands it over behind ``me`` (``after``: it was
    stopped, by a preemption for ``me``, and queued again: its new attempt waits for ``me``), or places it
    on another node than this one, ``node``; None otherwise.  Its old attempt may have returned before this
    wait left its marker, so the marker never tells; its new attempt's flow process is alive."""
    from e31.flows.queue.mapping import AFTER_VAR, NODE_VAR, PLACEMENT_PARAM

    placed = (run.parameters or {}).get(PLACEMENT_PARAM) or {}
    if me and me in str(placed.get(AFTER_VAR) or "").split(","):
        return "behind"
    if node and placed.get(NODE_VAR) and placed.get(NODE_VAR) != node:
        return "moved"
    return None


def wait_for_run_ahead(ahead: str, stop: Callable[[], bool] = lambda: False,
                       say: Callable[[str], None] = print, client: Any = None, me: str | None = None) -> float:
    """Block until the flow run ``ahead`` has ended: it removed the marker
    this wait leaves for it (:func:`release`, once its output is returned:
    that ends the wait at once), or its flow process is
    gone from this machine (:func:`flow_process_alive`, checked every
    :data:`POLL_S` s once its pid is known) or its state is final or back
    in the queue (:func:`requeued`; read
    every :data:`API_EVERY_S` s; every :data:`API_ALIVE_EVERY_S` s once its
    flow process is seen alive here), or it no longer exists; or until
    ``stop()`` is true (e.g. this run was cancelled), or the attempt ahead
    is over while the run lives on (:func:`attempt_over`: its placement
    hands it over behind ``me``, this run, or places it on another node).
    A run ahead whose
    flow process died during its return (:func:`cut_return_ahead`) has not
    ended: the wait goes on while its worker delivers that return (its
    state read every :data:`RETURNING_READ_S` s), until the return's
    pending record is no longer cut, or its state is final but not a fresh
    crash (:func:`fresh_crash`: the worker gave the return up) or back in
    the queue.  Once the run ahead
    has ended, the processes of its work still alive (its flow process was
    killed: they are orphans on this node's devices) are killed first
    (:func:`end_leftover_work`).  ``say`` gets one line when there is a
    wait, and one for processes killed.  An API that does not answer is read again at
    the next turn (the process check goes on).  Returns the seconds waited."""
    from prefect.exceptions import ObjectNotFound

    started = time.monotonic()
    marker = handover_dir() / str(ahead)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:  # no marker: the process and API checks still end the wait
        marker = None
    own = None
    if client is None:
        from prefect.client.orchestration import get_client

        own = client = get_client(sync_client=True)
        client.__enter__()
    from e31.prefect_compat.clock import watch

    watch(client)  # fresh_crash judges the run's state on the server's clock
    try:
        run, read_at, said, every, cut, over = None, float("-inf"), False, API_EVERY_S, False, None
        while not stop():
            ended = False
            if time.monotonic() - read_at >= every:
                read_at = time.monotonic()
                try:
                    run = client.read_flow_run(ahead)
                except ObjectNotFound:
                    break
                except Exception:  # the API is busy or away: the process check goes on
                    pass
                if run is not None and run.state is not None and (run.state.is_final() or requeued(run.state)):
                    if cut and not fresh_crash(run.state):  # its worker gave the return up (e31 return finishes it)
                        break
                    ended = True
                over = attempt_over(run, me, _this_node()) if run is not None and not cut else None
                if over is not None:
                    break
                if run is not None and not said:
                    said = True
                    say(f"handed over behind {run.name} ({ahead[:8]}): the work starts once it has returned its "
                        "output")
            if marker is not None and not marker.exists():
                break  # its own word (release): its output is returned, so its return was not cut
            if run is not None and run.infrastructure_pid:
                if not flow_process_alive(run):
                    ended = True
                elif not cut:
                    every = API_ALIVE_EVERY_S  # seen alive here: its end shows in /proc and its marker first
            if ended or cut:
                was, cut = cut, cut_return_ahead(run)
                if not cut:
                    break
                if not was:  # its flow process died in its return: its node's worker delivers it; the node is its
                    every = RETURNING_READ_S
                    say(f"{run.name} ({ahead[:8]}) was cut during the return of its output; the work starts once "
                        "its worker has finished that return")
            time.sleep(POLL_S)
        else:
            return time.monotonic() - started
        killed = end_leftover_work(ahead)  # a killed flow process's work may live on, on these devices
        if killed:
            say(f"the work of {ahead[:8]} outlived its flow process: its processes {killed} were killed")
        return time.monotonic() - started
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)
        if own is not None:
            own.__exit__(None, None, None)
