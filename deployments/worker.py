"""``e31 worker``: a Prefect worker that runs only the flow runs the E31
scheduler placed on its node, each with exactly its GPU devices.

A subclass of Prefect's process worker (type ``e31``, registered through
the ``prefect.collections`` entry point).  Its job configuration
(:mod:`e31.deployments.jobconfig`) adds the
placement the scheduler writes into a flow run's ``placement`` parameter
(``e31_node``, ``gpu_devices``, ``cpus``: :func:`e31.flows.queue.placement_of`);
a run placed on another node, or not placed yet, is left alone.  The flow process gets
``CUDA_VISIBLE_DEVICES`` (and ``E31_GPU_DEVICES``) of its devices and
``E31_NODE``.

At start the worker checks that this machine has what the pool file
declares for its node (GPUs, CPUs, memory) and refuses to start otherwise.

Flow processes start warm (:mod:`e31.deployments.warmstart`): the worker
keeps one process with Prefect and E31 imported and forks it per run, so a
run skips 1.3-3 s of imports.  ``E31_WARM_START=0`` starts every flow
process cold, as ``python -m prefect.engine`` (one process either way:
E31's entrypoint is a module path with no pull steps, so Prefect's
workspace supervisor process is not needed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from prefect.workers.process import ProcessWorker

from e31.deployments.jobconfig import E31JobConfiguration, E31Variables
from e31.deployments.killinfra import settle_late_cancel
from e31.prefect_compat.cancelgate import install as install_cancel_gate
from e31.deployments.runevents import PollGate
from e31.deployments.warmstart import WARM_SOCKET as _WARM_SOCKET, start_warm_process
from e31.flows.queue import NODE_VAR, WORKER_TYPE, placement_of
from e31.flows.queue.handover import end_leftover_work
from e31.deployments.nodecheck import NodeMismatch, check_node, node_gpus_override  # noqa: F401 (their home before)

#: ``0`` starts every flow process cold (to compare, or to rule warm starts out).
WARM_VAR = "E31_WARM_START"
#: Seconds between starts of the warm process when it keeps dying.
WARM_RESTART_S = 30.0
#: Seconds a worker waits, from its warm process's start, for it to listen before it takes runs (then cold).
WARM_READY_S = 60.0


class E31Worker(ProcessWorker):
    """Runs the flow runs placed on ``node`` (its worker name) and no other."""

    type = WORKER_TYPE
    job_configuration = E31JobConfiguration
    job_configuration_variables = E31Variables
    _description = "Runs E31 jobs placed on this worker's node by the E31 scheduler, with exactly their GPU devices."
    _display_name = "E31"
    _documentation_url = "https://github.com/"  # the README of the E31 repository

    def __init__(self, *args: Any, node: str, **kwargs: Any):
        kwargs.setdefault("name", node)
        super().__init__(*args, **kwargs)
        install_cancel_gate()  # a cancel after a run's work ended changes nothing (e31.prefect_compat.cancelgate)
        self.node = node
        self._warm: subprocess.Popen | None = None
        self._warm_at = 0.0  # time.monotonic() of the warm process's start
        self._listened: subprocess.Popen | None = None  # the warm process last seen listening
        self._depth = 0  # setup() calls not yet torn down
        self._followers: list[Any] = []  # the asyncio tasks that poll when a run is placed
        self._gate = PollGate()  # which polls ask the server (all until the event stream is up)
        self._returned: set[str] = set()  # flow run ids the server's answers to the polls gave (any node's)
        self.flows: dict[int, str] = {}  # pid -> flow run id of each flow process this worker started, while it runs
        self.draining = False  # stopping: no new run is taken (see drain())
        self._beats: Any = None  # the heartbeat's own thread (e31.deployments.presence.worker_beats)
        self._loop_seen = 0.0  # time.monotonic() when this worker's event loop last polled
        self._prefetch_base: float | None = None  # the prefetch seconds asked for, before the clock's skew
        self._told: set[int] = set()  # flow processes drain() signalled
        self._synced = False  # a sync has completed with the work pool known (the first one waits for warm)
        self._members: Any = None  # the gangs' members this node runs (e31.deployments.members.MemberRunner)

    async def setup(self) -> None:
        """Start the warm flow process (unless ``E31_WARM_START=0``), then
        Prefect's setup, then quick retries of the API's 503s
        (:mod:`e31.prefect_compat.busy`).  Prefect's ``start`` enters the
        worker again: one warm process serves both, ended by the outer teardown."""
        import time

        from e31.prefect_compat.busy import retry_busy_quickly

        if self._warm is None and os.environ.get(WARM_VAR, "1") != "0" and sys.platform != "win32":
            self._warm, self._warm_at = start_warm_process(self._work_pool_name), time.monotonic()  # importing while
            # Prefect's setup runs
        try:
            await super().setup()
            retry_busy_quickly(self._client)
            from e31.prefect_compat.clock import watch

            watch(self._client)  # the server's clock, from its answers (e31.prefect_compat.clock)
            self._depth += 1
            if self._depth == 1:
                await self._crash_orphans()
                await self._clear_fences()
                self._follow_placements()
                self._start_members()
        except BaseException:  # e.g. stopped while it set up: no teardown comes, and the warm process has no run
            if self._depth == 0 and self._warm is not None:
                self._warm.kill()
                self._warm = None
            raise

    async def sync_with_backend(self) -> None:
        """Prefect's sync (the work pool, the heartbeat that makes the node
        live for the scheduler); the first one waits for the warm process to
        listen (:meth:`_warm_ready`) unless a run holds this node: a worker
        started again is heard from at once, before the lease since its
        predecessor's last heartbeat runs out (a stuck warm process would
        otherwise hold it silent for 64 s, and its node be taken for lost)."""
        if not self._synced and self._client is not None:
            from e31.deployments.leftovers import node_held

            if not await node_held(self._client, self._work_pool_name, self.node):
                await self._warm_ready()
        if self._client is not None:
            await self._clear_fences()
        await super().sync_with_backend()
        if not self._synced:
            try:
                self._synced = self.work_pool is not None  # Prefect's property: raises until a sync has read the pool
            except RuntimeError:
                pass
        self._beat_apart()

    def _beat_apart(self) -> None:
        """After the first heartbeat: say the clock's skew against the
        server's (:func:`e31.prefect_compat.clock.skew_line`) and start the
        heartbeat's own thread (:func:`e31.deployments.presence.worker_beats`),
        which beats while this worker's event loop has polled within
        :data:`e31.deployments.presence.LOOP_STUCK_S`."""
        import time

        from e31.deployments.presence import LOOP_STUCK_S, worker_beats

        self._loop_seen = time.monotonic()
        if self._beats is not None or not self._synced:
            return
        say = lambda line: print(f"e31 worker: {line}", flush=True)  # noqa: E731
        self._beats = worker_beats(self._work_pool_name, self.name, self.heartbeat_interval_seconds,
                                   lambda: time.monotonic() - self._loop_seen < LOOP_STUCK_S, say)
        if (line := self._beats.news.news()) is not None:
            say(line)
        self._beats.start()

    async def _clear_fences(self) -> None:
        """Kill the processes on this machine of runs that no longer hold
        this node (lost with it while this worker or its predecessor was
        silent, crashed, ended), then lift the node's fences
        (:func:`e31.deployments.leftovers.clear_fences`): at the start, and
        at each heartbeat (a worker frozen or cut off past the lease is
        heard again), so its node takes new work only once they are gone."""
        import anyio

        from e31.deployments.leftovers import clear_fences

        with anyio.CancelScope(shield=True):
            await clear_fences(self._client, self._work_pool_name, self.node, self._logger, set(self.flows.values()),
                               {self._warm.pid} if self._warm is not None else set())

    async def _crash_orphans(self) -> None:
        """End the runs left holding this node with no flow process, and finish
        the returns they left cut (:func:`e31.deployments.leftovers.end_orphans`)."""
        from e31.deployments.leftovers import end_orphans

        def finish(run: Any, job: str) -> None:  # a cut return: finished beside the worker's start, not before it
            self._runs_task_group.start_soon(self._finish_cut_return, run, job, True)

        await end_orphans(self._client, self._work_pool_name, self.node, self._logger,
                          finish if self._runs_task_group is not None else None)

    def _follow_placements(self) -> None:
        """Poll at once when the scheduler places a run on this node, and
        nudge a flow process of this worker's whose run the queue preempts
        (:func:`e31.deployments.runevents.poll_on_placements`)."""
        from e31.deployments.runevents import poll_on_placements

        async def poll() -> set[str]:  # the runs this poll got from the server, any node's
            self._returned = set()
            await self.get_and_submit_flow_runs()
            return self._returned

        self._followers = poll_on_placements(self._work_pool_name, self.node, self._gate, poll, self._logger,
                                             self._preempting, self._placed_here, self._member_placed)

    def _member_placed(self, flow_run_id: str) -> None:
        """A multi-node run was placed with this node among its other nodes: its member starts now."""
        if self._members is not None:
            self._members.wake()

    def _start_members(self) -> None:
        """Start the thread that starts this node's members of multi-node runs
        (:class:`e31.deployments.members.MemberRunner`)."""
        from e31.deployments.members import MemberRunner

        self._members = MemberRunner(self._work_pool_name, self.node,
                                     lambda line: print(f"e31 worker: {line}", flush=True))
        self._members.start()

    async def _placed_here(self, flow_run_id: str) -> bool:
        """Whether the flow run ``flow_run_id`` still waits to be taken (a scheduled state: ``Placed``) and is
        placed on this node."""
        from uuid import UUID

        run = await self._client.read_flow_run(UUID(flow_run_id))
        return run.state is not None and run.state.is_scheduled() and placement_of(run).get(NODE_VAR) == self.node

    def _preempting(self, flow_run_id: str) -> None:
        """The queue preempts the flow run ``flow_run_id``: when its flow process is one of this worker's,
        nudge it to read its state now (:func:`e31.tasks.supervisor.cancel.nudge`), so its work is warned
        within a second, not at its next read."""
        from e31.tasks.supervisor.cancel import nudge

        if flow_run_id in self.flows.values():
            nudge(flow_run_id)

    async def teardown(self, *exc_info: Any) -> None:
        """Prefect's teardown; the outer one also stops following the
        placements and closes the warm process's stdin (it ends once the
        runs it forked end)."""
        import asyncio

        self._depth -= 1
        if self._depth == 0:
            import anyio

            for task in self._followers:
                task.cancel()
            with anyio.CancelScope(shield=True):  # a teardown under cancellation still waits for them
                await asyncio.gather(*self._followers, return_exceptions=True)
                if self._members is not None:  # each member warned, and given its grace
                    await anyio.to_thread.run_sync(self._members.stop)
            self._followers, self._members = [], None
        if self._beats is not None and self._depth == 0:
            self._beats.stop()
            self._beats = None
        if self._warm is not None and self._depth == 0:
            if self._listened is not self._warm and not (_WARM_SOCKET and os.path.exists(_WARM_SOCKET[0])):
                self._warm.kill()  # never listened (stuck at import): it has no run of its own
            _WARM_SOCKET.clear()
            self._warm.stdin.close()
            self._warm = None
        await super().teardown(*exc_info)

    async def run(self, flow_run: Any, configuration: Any, task_status: Any = None) -> Any:
        """Prefect's process worker's run, marking the flow process as staging
        on this machine from its start (:func:`e31.tasks.storage.transfer_markers.mark_starting`:
        the node's prefetcher pauses until the run's own staging ends).  When
        the flow process has ended, processes of its work that outlived it
        (it was killed) are killed
        (:func:`e31.flows.queue.handover.end_leftover_work`): the scheduler
        gives the node's resources to the next run.  After a flow process
        that failed, a run still ``Cancelling`` is marked ``Cancelled``
        (:func:`e31.deployments.leftovers.end_cancelling`)."""
        import anyio

        from e31.deployments.cutreturn import hold_cut_return
        from e31.deployments.leftovers import job_runs_elsewhere
        from e31.tasks.storage.transfer_markers import mark_starting

        self._keep_warm()
        spec = (flow_run.parameters or {}).get("spec")
        job = spec.get("name") if isinstance(spec, dict) else None
        outer = task_status if task_status is not None else anyio.TASK_STATUS_IGNORED

        worker, started_pid = self, []

        class _Started:
            def started(self, value: Any = None) -> None:
                if isinstance(value, int):
                    worker.flows[value] = str(flow_run.id)
                    started_pid.append(value)
                    if isinstance(job, str):
                        mark_starting(job, value)
                    if worker.draining:  # submitted before the drain, started after it: stopped as the others
                        worker.drain()
                outer.started(value)

        result = None
        try:
            result = await super().run(flow_run, configuration, task_status=_Started())
            return result
        finally:
            for pid in started_pid:
                self.flows.pop(pid, None)
            held = False
            try:
                with anyio.CancelScope(shield=True):  # first: a return it cut keeps the node (Pending, not Crashed)
                    held = await anyio.to_thread.run_sync(hold_cut_return, job, str(flow_run.id))
            except Exception:  # best effort: the scheduler leaves a fresh crash its node for SETTLE_S anyway
                pass
            try:
                with anyio.CancelScope(shield=True):  # also when the worker stops meanwhile
                    killed = [] if job_runs_elsewhere(job, str(flow_run.id)) else \
                        await anyio.to_thread.run_sync(end_leftover_work, str(flow_run.id))
            except Exception:  # best effort: /proc unreadable
                killed = []
            if killed:  # its flow process was killed and its work lived on: the node's resources go to the next run
                self._logger.warning("flow run %s ended with its work still running (pids %s): killed", flow_run.id,
                                     killed)
            await self._finish_cut_return(flow_run, job, held)
            with anyio.CancelScope(shield=True):  # a cancel that came after its work had ended: the manifest's state
                await anyio.to_thread.run_sync(settle_late_cancel, flow_run)
            if result is not None and result.status_code != 0:  # a cancel that came as it started left it Cancelling
                from e31.deployments.leftovers import end_cancelling

                await end_cancelling(self._client, flow_run.id, result.status_code, self._logger)

    async def kill_infrastructure(self, infrastructure_pid: str, configuration: Any, grace_seconds: int = 30) -> None:
        """Prefect's documented hook for stopping a run's infrastructure
        (:func:`e31.deployments.killinfra.kill_flow_process`): a flow process
        returning its output is waited for until it ends, any other of this
        worker's gets SIGTERM, then SIGKILL after ``grace_seconds``; a run
        still ``Cancelling`` is left to the runner's cancel sequence.  Raises
        Prefect's ``InfrastructureNotAvailable`` or ``InfrastructureNotFound``."""
        from e31.deployments.killinfra import kill_flow_process

        async def read(run_id: str) -> tuple[str | None, Any]:
            run = await self.client.read_flow_run(run_id)
            return (run.state.type.value if run.state is not None else None), run

        await kill_flow_process(infrastructure_pid, self.flows, read, grace_seconds, self._logger.warning)

    async def _finish_cut_return(self, flow_run: Any, job: Any, held: bool) -> None:
        """:func:`e31.deployments.cutreturn.close_cut_return` in a thread,
        shielded (also when the worker stops meanwhile: the return is
        bounded), its lines to the run's log.  Never raises."""
        import anyio

        from e31.deployments.cutreturn import close_cut_return

        run_logger = self.get_flow_run_logger(flow_run)
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(close_cut_return, job, str(flow_run.id), held, run_logger.warning)
        except Exception as exc:  # the state is a courtesy: the manifest at the destination is the job's word
            self._logger.warning("flow run %s: could not settle its state after its cut return: %s: %s",
                                 flow_run.id, type(exc).__name__, exc)

    def drain(self, signum: int = signal.SIGTERM) -> int:
        """Stop taking runs, and send ``signum`` to each flow process this
        worker started: each stops its work and returns its output marked
        ``partial`` (reason ``signal``), as a Ctrl-C of ``e31 run`` does.
        Returns how many were signalled.  ``e31 worker`` calls it on its first
        SIGINT or SIGTERM, and exits once they have ended."""
        self.draining = True
        told = self._members.drain(signum) if self._members is not None else 0
        for pid in [p for p in self.flows if p not in self._told]:  # each once: a second signal is not a stronger one
            self._told.add(pid)
            try:
                os.kill(pid, signum)
                told += 1
            except ProcessLookupError:
                self.flows.pop(pid, None)
        return told

    async def _give_worker_labels_to_flow_run(self, flow_run_id: Any) -> None:
        """Prefect's labels naming this worker on the run, written beside the
        run's start instead of before it: the write is a read-then-write
        transaction that a busy SQLite database answers with 503, and the
        run's start waited for its resends (:mod:`e31.prefect_compat.busy`).
        A label write that fails is logged; the run goes on."""
        parent = super()._give_worker_labels_to_flow_run

        async def label() -> None:
            try:
                await parent(flow_run_id)
            except Exception as exc:
                self._logger.warning("could not label flow run %s with its worker: %s: %s", flow_run_id,
                                     type(exc).__name__, exc)

        if self._runs_task_group is None:
            await label()
        else:
            self._runs_task_group.start_soon(label)

    def _keep_warm(self) -> None:
        """Start a new warm process when the worker's died, at most once per
        :data:`WARM_RESTART_S` (one that cannot start is not retried in a
        loop); runs meanwhile start cold."""
        import time

        if self._warm is None or self._warm.poll() is None or time.monotonic() - self._warm_at < WARM_RESTART_S:
            return
        import shutil

        self._logger.warning("the warm flow process ended (exit status %s); starting another (runs start cold "
                             "meanwhile)", self._warm.returncode)
        if _WARM_SOCKET:
            shutil.rmtree(Path(_WARM_SOCKET[0]).parent, ignore_errors=True)
        self._warm, self._warm_at = start_warm_process(self._work_pool_name), time.monotonic()

    async def _get_scheduled_flow_runs(self) -> list[Any]:
        """Prefect's scheduled runs of the pool, less those not placed on this
        node (each poll also restarts a warm process that died); none, without
        asking the server, when :class:`PollGate` says this poll need not."""
        import time

        from e31.prefect_compat.clock import offset_s

        self._loop_seen = time.monotonic()
        self._keep_warm()
        await self._warm_ready()
        if self.draining or not self._gate.ask():
            return []
        if self._prefetch_base is None:
            self._prefetch_base = self._prefetch_seconds
        # Prefect asks for runs scheduled before this machine's now + prefetch; a run is placed at the server's
        # now: a clock behind the server's would leave it unseen for the skew
        self._prefetch_seconds = self._prefetch_base + max(0.0, offset_s() or 0.0)
        runs = await super()._get_scheduled_flow_runs()
        self._returned.update(str(r.flow_run.id) for r in runs)
        return [r for r in runs if placement_of(r.flow_run).get(NODE_VAR) == self.node]

    async def _warm_ready(self) -> None:
        """Wait while the warm process is starting (alive, no socket yet; at
        most :data:`WARM_READY_S` s from its start): a run taken meanwhile
        starts cold beside its imports (13-15 s to ``Running`` on 2 busy
        cores).  Runs placed meanwhile stay ``Placed`` until this poll."""
        import asyncio
        import time

        while self._warm is not None and self._warm.poll() is None and _WARM_SOCKET \
                and not os.path.exists(_WARM_SOCKET[0]) and time.monotonic() - self._warm_at < WARM_READY_S:
            await asyncio.sleep(0.1)
        if _WARM_SOCKET and os.path.exists(_WARM_SOCKET[0]):
            self._listened = self._warm  # this warm process listened (it may have runs of its own)
