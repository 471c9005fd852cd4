"""What an ``e31 worker`` ends that nobody else would: runs left holding its
node by a flow process that is gone.

The scheduler counts a run ``Pending``, ``Running`` or ``Cancelling`` as
holding its node's resources (:func:`e31.flows.queue.snapshot.read`), and
only the lease ends the runs of a node whose worker is silent.  Two ways a
run can be left so while its node's worker is alive:

- the previous worker of the node was killed with its flow processes, and
  this worker's heartbeats keep the node alive (:func:`end_orphans`, at
  the worker's start);
- a cancel came while the run was starting: Prefect's engine refuses to run
  a ``Cancelling`` run and exits (``UnfinishedRun``), and nothing else moves
  the run on (:func:`end_cancelling`, after a flow process that failed).

A run that was being cancelled always ends ``Cancelled`` here, never
``Crashed``: the scheduler requeues crashed runs, and a cancelled job must
not run again.

And the processes a run left on this machine after it stopped holding the
node (:func:`clear_fences`, at the worker's start and at each of its
heartbeats): a run taken for lost with its node while its worker was
silent, whose flow process and work may live on, and a run that is no
longer ``Pending``/``Running`` here.  They are killed, and only then is a
lost run's fence lifted: the node's devices go to other work once its
processes are gone.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from e31.prefect_compat.clock import server_now
from e31.flows.queue.handover import flow_process_alive
from e31.flows.queue.mapping import NODE_VAR, placement_of
from e31.tasks.placement_record import record_of


def _cancelled_message(why: str) -> str:
    return f"cancelled (a cancel was requested); {why}"


async def node_held(client: Any, work_pool: str, node: str) -> bool:
    """Whether a run of ``work_pool`` holds ``node`` (``Pending``,
    ``Running``, ``Cancelling``, or ``Scheduled`` named ``Placed``, placed on
    it): a worker started again for a node with runs must be heard from at
    once, before the scheduler's lease takes the node for lost.  An API that
    does not answer counts as held."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType

    try:
        runs = await client.read_flow_runs(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[work_pool])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING, StateType.SCHEDULED]))), limit=200)
    except Exception:
        return True
    return any(placement_of(r).get(NODE_VAR) == node and (
        r.state.type != StateType.SCHEDULED or r.state.name == "Placed") for r in runs)


async def end_orphans(client: Any, work_pool: str, node: str, logger: logging.Logger | logging.LoggerAdapter,
                      finish: Callable[[Any, str], None] | None = None) -> int:
    """End the runs of ``work_pool`` placed on ``node`` that are ``Pending``,
    ``Running`` or ``Cancelling`` and whose flow process is not on this
    machine (:func:`e31.flows.queue.handover.flow_process_alive`):
    ``Crashed`` (the scheduler requeues those with retries left), or
    ``Cancelled`` for a run that was ``Cancelling``.  A run whose flow
    process died in the middle of the return of its output (its job's
    scratch here keeps that return, cut: :func:`e31.tasks.pending.cut_return_of`)
    is instead held ``Pending`` named ``Returning`` (its node stays its own)
    and handed to ``finish(run, job)``, which finishes the return and sets
    its state from the manifest (the worker's
    :func:`e31.deployments.cutreturn.close_cut_return`, in the background):
    before, when its worker had been killed too, the output waited for
    ``e31 return JOB``.  ``client``: Prefect's async client.  Returns how
    many runs were ended or handed to ``finish``.  Best effort: a failure
    is logged, and the worker starts anyway."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType

    from e31.deployments.cutreturn import RETURNING, hand_cut_return
    from e31.flows.compile import default_scratch_root
    from e31.states import cancelled, crashed
    from e31.tasks.pending import cut_return_of

    ended = 0
    try:
        runs = await client.read_flow_runs(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[work_pool])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]))), limit=200)
        for run in runs:
            if placement_of(run).get(NODE_VAR) != node or flow_process_alive(run):
                continue
            job = _job_of(run)
            cut = job is not None and cut_return_of(default_scratch_root() / job, str(run.id))
            if finish is not None and job is not None and (cut or run.state.name == RETURNING):
                handed = await hand_cut_return(client, run, job, node, logger, finish)  # under the job's lock
                if handed is not None:
                    ended += handed
                    continue
            # read after the look at the scratch: a return another process here delivered in between (a second
            # worker for this node) moved the state on first (Returning, then its verdict): not to be overwritten
            now = (await client.read_flow_run(run.id)).state
            if now is None or run.state is None or now.id != run.state.id:
                continue
            gone = (f"its flow process is gone: node {node}'s e31 worker started again and found no process for "
                    "it on this machine; its resources are free again")
            cancelling = run.state.type == StateType.CANCELLING
            await client.set_flow_run_state(run.id, cancelled(_cancelled_message(gone)) if cancelling
                                            else crashed(gone), force=True)
            logger.warning("flow run %s (%s) had no flow process left on this machine: marked %s", run.id, run.name,
                           "Cancelled" if cancelling else "Crashed")
            ended += 1
    except Exception as exc:
        logger.warning("could not check this node's runs left by an earlier worker: %s: %s", type(exc).__name__, exc)
    return ended


#: Seconds a run's final state must be old before this worker kills processes of it that it did not start
#: (unfenced): a flow process ends within seconds of writing its final state (its last logs and events).
FINAL_GRACE_S = 30.0


def node_processes(node: str) -> dict[str, list[int]]:
    """Flow run id -> the pids of the live processes on this machine whose
    environment names that run (``PREFECT__FLOW_RUN_ID``; ``E31_MEMBER_OF``
    for a gang's member and its work) and ``node`` (``E31_NODE``, which
    ``e31 worker`` gives each flow process and member, and their work
    inherits): a run's flow process or member, and its work.  Linux (``{}``
    without ``/proc``); a process that cleared its environment is not found.
    A warm process and its forks (:mod:`e31.deployments.warmstart`) are
    never counted: ``/proc`` shows the warm process's own environment for
    each of them (a fork's run environment is set after the fork), so a
    run named there (the worker's, inherited: ``e31 worker`` started from
    a flow run) is none of theirs; a warm fork is reached through its
    work (:func:`_warm_forks_above`)."""
    from e31.tasks.supervisor.process import processes_where

    run_marks, node_mark, found = (b"PREFECT__FLOW_RUN_ID=", MEMBER_MARK), f"E31_NODE={node}".encode(), {}
    marked: dict[int, str] = {}

    def match(environ: list[bytes]) -> bool:
        if node_mark not in environ:
            return False
        run = next((e[len(mark):] for e in environ for mark in run_marks if e.startswith(mark)), None)
        if not run:
            return False
        marked[len(marked)] = run.decode(errors="replace")
        return True

    for i, pid in enumerate(processes_where(match)):
        try:
            if WARM_MARK in open(f"/proc/{pid}/cmdline", "rb").read():
                continue
        except OSError:  # ended since
            continue
        found.setdefault(marked[i], []).append(pid)
    return found


#: The environment variable naming the flow run of a gang's member (:mod:`e31.flows.gang.member`) and its work:
#: set by the member's ``e31 worker`` (:mod:`e31.deployments.members`).
MEMBER_VAR = "E31_MEMBER_OF"
MEMBER_MARK = f"{MEMBER_VAR}=".encode()

#: What the command line of a warm flow process, and so of each of its forks, holds.
WARM_MARK = b"e31.deployments.warmstart"


def _kill_all(pids: list[int], wait_s: float = 10.0) -> list[int]:
    """SIGKILL ``pids`` and wait up to ``wait_s`` seconds until each is gone
    (a zombie counts as gone).  Returns those that remain."""
    import time
    from pathlib import Path

    from e31.tasks.supervisor.process import sigkill_each

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    sigkill_each(pids)
    deadline = time.monotonic() + wait_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def _warm_forks_above(pids: list[int], spare: set[int] | frozenset[int]) -> list[int]:
    """The parents of ``pids`` that are forks of a warm flow process (their
    command line is :mod:`e31.deployments.warmstart`'s, and so is their own
    parent's): a flow process forked warm keeps its warm process's
    environment in ``/proc`` (its run's is set after the fork), so only its
    work names the run.  Never a warm process itself (a warmstart process
    whose parent is not one: any worker's, this one's or a predecessor's
    still serving its last runs), this process, or those in ``spare``."""
    def parent_of(pid: int) -> int:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])

    def warm(pid: int) -> bool:
        return WARM_MARK in open(f"/proc/{pid}/cmdline", "rb").read()

    found = []
    for pid in pids:
        try:
            parent = parent_of(pid)
            if parent <= 1 or parent == os.getpid() or parent in spare or parent in pids or parent in found:
                continue
            if warm(parent) and warm(parent_of(parent)):
                found.append(parent)
        except (OSError, IndexError, ValueError):
            continue
    return found


async def clear_fences(client: Any, work_pool: str, node: str, logger: logging.Logger | logging.LoggerAdapter,
                       own: set[str] | frozenset[str] = frozenset(),
                       spare: set[int] | frozenset[int] = frozenset()) -> list[str]:
    """Kill the processes on this machine of ``node``'s runs that no longer
    hold it, then lift the fences of ``node`` whose run has no process left
    here (:mod:`e31.tasks.supervisor.fence`): the scheduler gives a fenced
    node's devices to other work only after that.

    A run's processes (:func:`node_processes`) are killed when the run is
    fenced on ``node`` (taken for lost with it), or is not ``Pending``,
    ``Running`` or ``Cancelling`` placed on ``node`` (crashed, queued again,
    placed elsewhere, or final for :data:`FINAL_GRACE_S` seconds).  Runs in
    ``own`` (those whose flow process this worker started and still
    watches) are left alone, and so are the pids in ``spare`` (its warm
    process).  ``client``: Prefect's async client.  Returns
    the ids of the runs whose fence was lifted.  A fence whose run still
    has a process here (one that did not die within 10 s of SIGKILL) stays,
    and is tried again at the next call.  Best effort: a failure is logged."""
    from prefect.exceptions import ObjectNotFound

    from e31.tasks.supervisor.fence import read_fences_async

    lifted: list[str] = []
    try:
        # the processes first, then the fences: a fence read after them was there when they were listed, so
        # they are the lost attempt's (the run can start here again only once its fence is lifted)
        found = {run: pids for run, pids in node_processes(node).items() if run not in own}
        named = {name: f for name, f in (await read_fences_async(client, work_pool)).items() if f["node"] == node}
        fences = {str(f["run"]): f for f in named.values()}
        for run, pid in _lock_holders(fences, own).items():  # a warm fork with no work: /proc names no run for it
            if pid not in found.get(run, ()):
                found.setdefault(run, []).append(pid)
        left_of: dict[str, list[int]] = {}
        for run, pids in found.items():
            if run not in fences:
                try:
                    flow_run = await client.read_flow_run(run)
                except Exception:  # not of this server (deleted): not ours to judge
                    continue
                state = flow_run.state
                kind = state.type.value if state is not None else None
                if kind in ("PENDING", "RUNNING", "CANCELLING") and placement_of(flow_run).get(NODE_VAR) == node:
                    continue  # holds the node: a run its predecessor started, running on
                if kind in ("SCHEDULED", "PENDING", "RUNNING", "CANCELLING") and \
                        node in record_of(flow_run).nodes[1:]:
                    continue  # a gang's member here: from its placement (Placed) to its end
                if kind in ("COMPLETED", "FAILED", "CANCELLED") and state.timestamp is not None and \
                        server_now() - state.timestamp.timestamp() < FINAL_GRACE_S:  # the server's clock
                    continue  # its flow process is ending by itself
            pids = pids + _warm_forks_above(pids, spare)
            left = left_of[run] = _kill_all(pids)
            logger.warning("flow run %s no longer holds node %s%s: its processes here (pids %s) killed%s", run, node,
                           " (lost with it while its worker was silent)" if run in fences else "", sorted(pids),
                           f"; pids {left} did not end" if left else "")
        rest = node_processes(node)
        holders = _lock_holders(fences, own)
        for name, fence in named.items():
            run = str(fence["run"])
            if rest.get(run) or left_of.get(run) or run in holders:  # every process it was found with is gone
                continue
            try:
                await client.delete_variable_by_name(name)
            except ObjectNotFound:  # lifted meanwhile by the run's own flow process
                pass
            lifted.append(run)
            logger.warning("flow run %s (%s), lost with node %s: no process of it remains on this machine; the "
                           "node's fence is lifted", run, fence.get("job"), node)
    except Exception as exc:
        logger.warning("could not check this node's lost runs: %s: %s", type(exc).__name__, exc)
    return lifted


def _lock_holders(fences: dict[str, dict], own: set[str] | frozenset[str]) -> dict[str, int]:
    """Fenced run id -> the pid of the live process on this machine that
    holds its job's lock (``$E31_SCRATCH/<job>/job.lock`` naming that run:
    :func:`e31.flows.joblock.lock_holder`, the pid checked to hold the lock
    file open, as :func:`job_runs_elsewhere` does): its flow process from
    before its work starts (staging, or waiting behind the job ahead) to
    its end.  A flow process forked from a warm process shows the warm
    process's environment in ``/proc``, so without a work below it
    :func:`node_processes` cannot name its run.  Runs in ``own`` are
    left out, and so is a zombie (gone)."""
    from e31.flows.compile import default_scratch_root
    from e31.flows.joblock import lock_holder

    found: dict[str, int] = {}
    for run, fence in fences.items():
        job = fence.get("job")
        if run in own or not isinstance(job, str) or not job or "/" in job or job.startswith("."):
            continue
        lock = default_scratch_root() / job / "job.lock"
        pid, holder = lock_holder(str(lock.parent))
        if pid is None or holder != run or pid == os.getpid() or not _running(pid):
            continue
        try:
            if any(os.path.realpath(f"/proc/{pid}/fd/{fd}") == str(lock.resolve()) for fd in os.listdir(
                    f"/proc/{pid}/fd")):
                found[run] = pid
        except OSError:  # gone meanwhile, or not ours to read (then not ours to kill either)
            continue
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has: killed, not yet reaped)."""
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _job_of(run: Any) -> str | None:
    """The job name of a flow run of ``run_job`` (its ``spec`` parameter's ``name``), or None."""
    spec = (run.parameters or {}).get("spec")
    name = spec.get("name") if isinstance(spec, dict) else None
    return name if isinstance(name, str) else None


async def end_cancelling(client: Any, flow_run_id: Any, status_code: int,
                         logger: logging.Logger | logging.LoggerAdapter) -> bool:
    """After the flow process of ``flow_run_id`` ended with ``status_code``
    (non-zero): mark the run ``Cancelled`` if it is still ``Cancelling``
    (``Cancelled`` named ``Preempted`` when the queue preempted it: it is
    queued again).  True when it did.  Best effort: a failure is logged."""
    from e31.states import PREEMPTING, cancelled, preempted

    try:
        run = await client.read_flow_run(flow_run_id)
        if run.state is None or run.state.type.value != "CANCELLING":
            return False
        if run.state.name == PREEMPTING:  # the queue's: it takes the run back and it resumes from its checkpoint
            await client.set_flow_run_state(flow_run_id, preempted(
                f"{run.state.message}; its flow process ended (exit status {status_code}) before its return was "
                "done: it resumes from its newest durable checkpoint"), force=True)
            logger.warning("flow run %s was preempted and its flow process ended (exit status %s): marked "
                           "Preempted, to be queued again", flow_run_id, status_code)
            return True
        await client.set_flow_run_state(flow_run_id, cancelled(_cancelled_message(
            f"its flow process ended (exit status {status_code}) before the cancel was done; its resources are free "
            "again (a manifest at its destination, if any, says what was returned)")), force=True)
        logger.warning("flow run %s was still Cancelling after its flow process ended (exit status %s): marked "
                       "Cancelled", flow_run_id, status_code)
        return True
    except Exception as exc:
        logger.warning("could not check flow run %s after its flow process failed: %s: %s", flow_run_id,
                       type(exc).__name__, exc)
        return False


def job_runs_elsewhere(job: Any, flow_run_id: str) -> bool:
    """Whether the job named ``job`` (None: unknown) is held on this machine
    by a live process of the flow run ``flow_run_id`` (its lock in
    ``$E31_SCRATCH/<job>/job.lock``, :func:`e31.flows.joblock.lock_holder`):
    the first flow process of a run that was started a second time (its
    node taken for lost while its worker was down), which the second start
    left it to.  Its work's processes, which carry the same flow run id, are
    then not leftovers to kill."""
    from e31.flows.compile import default_scratch_root
    from e31.flows.joblock import lock_holder

    if not isinstance(job, str):
        return False
    lock = default_scratch_root() / job / "job.lock"
    pid, run = lock_holder(str(lock.parent))
    if pid is None or run != flow_run_id or pid == os.getpid():
        return False
    try:  # alive and holding the lock file open (a pid reused since by another process is not)
        return any(os.path.realpath(f"/proc/{pid}/fd/{fd}") == str(lock.resolve()) for fd in os.listdir(
            f"/proc/{pid}/fd"))
    except FileNotFoundError:  # gone
        return False
    except OSError:  # not ours to read, or no /proc: do not kill what may be its work
        return True
