"""The queue's commands: ``e31 scheduler``, ``e31 worker``, ``e31 submit``,
``e31 queue``, ``e31 cancel`` (registered by :mod:`e31.flows.cli`).

    e31 scheduler --pool POOL.yaml [--policy e31|fcfs|easy] [--interval S] [--once]
    e31 worker --pool POOL.yaml --node NAME
    e31 submit SPEC --pool POOL.yaml [--set FIELD=VALUE ...]
    e31 queue --pool POOL.yaml
    e31 cancel JOB|RUN_ID --pool POOL.yaml
"""

from __future__ import annotations

import argparse
import getpass
import os
import signal
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from e31.errors import EXIT_FAILED, EXIT_INVALID, EXIT_OK, E31Error


def _seconds(least: float, strict: bool, why: str) -> Callable[[str], float]:
    """An argparse type: a number of seconds above ``least`` (``strict``) or
    at least it; else argparse's error naming the option, with ``why``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if value != value or value in (float("inf"), float("-inf")) or value < least or (strict and value == least):
            raise argparse.ArgumentTypeError(f"{text} seconds: give {'more than' if strict else 'at least'} "
                                             f"{least:g} ({why})")
        return value
    return parse


def add_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Add the queue's parsers to ``sub`` (argparse subparsers); returns
    command name -> handler."""
    s = sub.add_parser("scheduler", help="run the planner service of a pool (one per pool)",
                       description="place the pool's queued flow runs with the planner, every few seconds")
    s.add_argument("--pool", required=True, help="pool file (YAML)")
    s.add_argument("--policy", default="e31", choices=("e31", "fcfs", "easy", "edf"), help="planning policy")
    s.add_argument("--interval", type=_seconds(0, True, "the seconds between ticks"), default=2.0,
                   help="seconds between ticks when nothing changes")
    s.add_argument("--once", action="store_true", help="one tick, then exit")
    s.add_argument("--lease", type=_seconds(10, False, "a worker's heartbeat comes every 10 s: a shorter lease "
                                                         "takes live nodes for lost and crashes their runs"),
                   default=60.0,
                   help="seconds without a worker heartbeat after which its node's runs are crashed and requeued "
                        "(default 60; workers beat every 10 s)")
    s.add_argument("--handover", type=_seconds(0, False, "0 turns handovers off"), default=10.0, metavar="SECONDS",
                   help="hand a node's resources over to the next job planned on them this many seconds before the "
                        "running job's planned end: its flow process starts and stages its inputs meanwhile, and its "
                        "work starts once the job ahead has returned its output (default 10; 0: off)")
    w = sub.add_parser("worker", help="run the jobs placed on one node of a pool",
                       description="a Prefect worker (type e31) that runs only the flow runs placed on --node")
    w.add_argument("--pool", required=True, help="pool file (YAML)")
    w.add_argument("--node", required=True, help="this machine's node name in the pool file")
    m = sub.add_parser("submit", help="queue a job on a pool", description="queue a job on a pool; print its "
                                                                            "flow run id and its place in the plan")
    m.add_argument("spec", help="job spec file")
    m.add_argument("--pool", required=True, help="pool file (YAML)")
    m.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field by dotted path")
    m.add_argument("--tenant", help="the pool's tenant the job is for (default: the tenant whose members include "
                                    "you, else default)")
    q = sub.add_parser("queue", help="list a pool's queued and running jobs",
                       description="every queued and running job: node, devices, planned start, reason")
    q.add_argument("--pool", required=True, help="pool file (YAML)")
    c = sub.add_parser("cancel", help="cancel a queued or running job", description="cancel a job of the pool: "
                                                                                    "a queued one leaves the queue, "
                                                                                    "a running one stops")
    c.add_argument("job", help="the job's name or its flow run id")
    c.add_argument("--pool", required=True, help="pool file (YAML)")
    n = sub.add_parser("node", help="show a node's fences; --down: the machine is off, its lost runs ended",
                       description="a node taken for lost while its jobs ran takes no new job until their processes "
                                   "are confirmed gone; --down says the machine is off for good")
    n.add_argument("node", help="the node's name in the pool file")
    n.add_argument("--pool", required=True, help="pool file (YAML)")
    n.add_argument("--down", action="store_true", help="declare the machine off: its lost runs' retries may start "
                                                       "elsewhere")
    from e31.deployments.cancelcmd import cmd_cancel
    from e31.deployments.usagecmd import add_usage, cmd_usage

    add_usage(sub)
    return {"scheduler": cmd_scheduler, "worker": cmd_worker, "submit": cmd_submit, "queue": cmd_queue,
            "cancel": cmd_cancel, "node": cmd_node, "usage": cmd_usage}


def cmd_node(args: argparse.Namespace) -> int:
    from e31.deployments.nodes import cmd_node as node

    _need_api()
    return node(args)


def _pool(path: str):
    from e31.specs.pool import load_pool

    return load_pool(path)


def _need_api() -> None:
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise _NoServer("the queue lives on a Prefect server: start one (prefect server start) and set "
                        "PREFECT_API_URL on every machine of the pool")


class _NoServer(E31Error):
    exit_code = EXIT_FAILED


def _server_clock() -> datetime:
    """Now on the Prefect server's clock (:func:`e31.prefect_compat.clock.server_now`, UTC): the scheduler's
    lines are stamped as the runs' states and the workers' heartbeats they speak of."""
    from e31.prefect_compat.clock import server_now

    return datetime.fromtimestamp(server_now(), timezone.utc)


def cmd_scheduler(args: argparse.Namespace) -> int:
    from e31.deployments.presence import SchedulerRunning
    from e31.deployments.scheduler import serve

    pool = _pool(args.pool)
    _need_api()

    def report(t) -> None:
        done = ", ".join(f"{v} {k}" for k, v in t.counts.items() if v and k != "unchanged")
        busy = f"; {t.resent} request(s) sent again, the database was busy" if t.resent else ""
        print(f"{_server_clock():%H:%M:%S} {t.queued} queued, {t.running} running: {done} "
              f"(read {t.read_s * 1000:.0f} ms {'full' if t.full else 'changes'}, plan {t.plan_s * 1000:.0f} ms, "
              f"cycle {t.cycle_s * 1000:.0f} ms{busy})", flush=True)
        for node, what in t.overbooked.items():  # planned as full until the runs that hold it longest end
            print(f"  node {node} holds more than it has: {what}; planned as full until they end", flush=True)

    print(f"e31 scheduler: pool {pool.name}, {sum(n.count for n in pool.nodes)} node(s), policy {args.policy}",
          flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped by a service manager: as by Ctrl-C
    try:
        serve(pool, policy=args.policy, interval_s=args.interval, once=args.once, report=report, lease_s=args.lease,
              handover_s=args.handover)
    except KeyboardInterrupt:  # the pool is released on the way out (serve's own finally): a standby takes over
        print(f"e31 scheduler: stopped; another scheduler may serve pool {pool.name} now", flush=True)
    except SchedulerRunning as exc:  # --once while another scheduler serves the pool
        print(f"e31 scheduler: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


#: Seconds ``e31 worker`` waits, after its first SIGINT or SIGTERM, for its running jobs to stop and
#: return their output (``E31_WORKER_STOP_S``); a second signal stops it at once.
WORKER_STOP_S = 300.0


async def serve_until_stopped(worker: Any) -> None:
    """Run ``worker`` (an :class:`e31.deployments.worker.E31Worker`, not
    entered: Prefect's ``start`` enters it) until SIGINT or SIGTERM.  The first signal drains it: no new run is
    taken, each running flow process is told to stop (it returns its output
    marked ``partial``), and the worker exits once they have ended, or after
    ``E31_WORKER_STOP_S`` seconds (default :data:`WORKER_STOP_S`); a second
    signal exits at once (Prefect's teardown ends what still runs, and the
    runs end ``Crashed``).  Without the drain, a Ctrl-C in the worker's
    terminal ended its flow processes before they returned anything, and a
    run it left ``Running`` held its node."""
    import signal

    import anyio

    grace = float(os.environ.get("E31_WORKER_STOP_S") or WORKER_STOP_S)
    async with anyio.create_task_group() as group:
        async def serve() -> None:
            await worker.start()
            group.cancel_scope.cancel()

        async def stop_when_drained() -> None:
            with anyio.move_on_after(grace):
                while worker.flows:
                    await anyio.sleep(0.2)
            group.cancel_scope.cancel()

        group.start_soon(serve)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                if worker.draining:
                    print("e31 worker: stopping now", flush=True)
                    group.cancel_scope.cancel()
                    break
                told = worker.drain(signum)
                print("e31 worker: stopping: no new job is taken; " + (
                    f"{told} running job(s) told to stop and return their output (waiting up to {grace:g} s; send "
                    "the signal again to stop now)" if told else "no job is running here"), flush=True)
                group.start_soon(stop_when_drained)


def cmd_worker(args: argparse.Namespace) -> int:
    import anyio
    from prefect.settings import PREFECT_WORKER_QUERY_SECONDS, temporary_settings

    from e31.deployments.nodecheck import check_node, node_overrides
    from e31.deployments.worker import E31Worker
    from e31.flows.queue import nodes_of, work_pool_name

    pool = _pool(args.pool)
    _need_api()
    declared = next((n for n in nodes_of(pool) if n.name == args.node), None)
    if declared is None:
        names = ", ".join(n.name for n in nodes_of(pool)[:10])
        print(f"e31: worker: no node {args.node!r} in pool {pool.name} (nodes: {names})", file=sys.stderr)
        return EXIT_INVALID
    check_node(declared, *node_overrides())
    query = float(os.environ.get("PREFECT_WORKER_QUERY_SECONDS") or 1)  # released runs start within a second or two

    async def run() -> None:  # Prefect's start() enters the worker itself (setup, then teardown at its end)
        await serve_until_stopped(E31Worker(work_pool_name=work_pool_name(pool), node=args.node, prefetch_seconds=5,
                                            heartbeat_interval_seconds=10))

    print(f"e31 worker: node {args.node} of pool {pool.name}", flush=True)
    _quiet_network_tracebacks()
    prefetcher = _start_prefetch(args.pool, args.node, pool)
    try:
        with temporary_settings(updates={PREFECT_WORKER_QUERY_SECONDS: query}):
            try:
                anyio.run(run)
            except KeyboardInterrupt:
                pass
    finally:
        if prefetcher is not None:
            prefetcher.kill()  # a copy cut short leaves only a temporary folder, which no run reuses
            prefetcher.wait()
    return EXIT_OK


def _quiet_network_tracebacks() -> None:
    """Prefect's logging set up, then its console handler shows a network error (the server frozen or
    away: a closed event stream, a timeout) in one line, not a traceback
    (:func:`e31.prefect_compat.runlog.hide_tracebacks_on_console`)."""
    from prefect.logging.configuration import setup_logging

    from e31.prefect_compat.runlog import hide_tracebacks_on_console

    setup_logging()
    hide_tracebacks_on_console()


def _start_prefetch(pool_path: str, node: str, pool: Any) -> Any:
    """Start the node's prefetcher (:mod:`e31.deployments.prefetch`) when its
    pool line declares a ``scratch_budget``, kept running; returns its
    :class:`_Supervised` or None."""
    from e31.deployments.prefetch import prefetch_rate

    line = next(line for name, line in pool.node_lines() if name == node)
    if not line.scratch_budget:
        return None
    from e31.tasks.storage.progress import human_bytes

    rate = prefetch_rate()
    print(f"e31 worker: prefetching the inputs of jobs planned on {node} (scratch_budget "
          f"{human_bytes(line.scratch_budget)}" + (f", at most {human_bytes(rate)}/s" if rate else "") + ")", flush=True)
    return _Supervised([sys.executable, "-m", "e31.deployments.prefetch", "--pool", pool_path, "--node", node])


class _Supervised:
    """A child process started again (after :data:`RESTART_S` seconds, said
    on stdout) whenever it ends, until :meth:`kill`: the worker's prefetcher,
    which a run waiting on a stalled prefetch of its job may kill."""

    RESTART_S = 5.0

    def __init__(self, argv: list[str]) -> None:
        import subprocess
        import threading

        self.argv, self._stop = argv, threading.Event()
        self.proc = subprocess.Popen(argv)
        self._thread = threading.Thread(target=self._watch, daemon=True, name="e31-prefetch-supervisor")
        self._thread.start()

    def _watch(self) -> None:
        import subprocess

        while not self._stop.is_set():
            code = self.proc.wait()
            if self._stop.wait(self.RESTART_S):
                return
            print(f"e31 worker: the prefetcher ended (exit {code}); started again", flush=True)
            self.proc = subprocess.Popen(self.argv)

    def kill(self) -> None:
        """Stop it for good (SIGKILL: a copy cut short leaves only a temporary folder)."""
        self._stop.set()
        self.proc.kill()

    def wait(self) -> None:
        self.proc.wait()
        self._thread.join(timeout=1)


def cmd_submit(args: argparse.Namespace) -> int:
    from prefect.client.orchestration import get_client

    from e31.deployments.presence import scheduler_note
    from e31.deployments.runwords import submitted_line
    from e31.deployments.scheduler import snapshot
    from e31.deployments.worker import E31Worker
    from e31.flows.checks import SpecChecks
    from e31.flows.deploy import job_tags, parameters
    from e31.flows.queue import submit
    from e31.flows.queue.tenancy import TENANT_TAG, choose_tenant
    from e31.specs import load_spec
    from e31.prefect_compat.busy import retry_busy_quickly

    pool = _pool(args.pool)
    tenant = choose_tenant(pool, args.tenant, getpass.getuser())
    _need_api()
    checks = SpecChecks(code_dir=str(Path(args.spec).resolve().parent))
    spec = load_spec(args.spec, overrides=args.overrides, checks=checks)
    with retry_busy_quickly(get_client(sync_client=True)) as client:
        run = submit(client, pool, parameters(spec, str(Path(args.spec).resolve().parent)),
                     [*job_tags(spec), TENANT_TAG + tenant], E31Worker.get_default_base_job_template())
        snap = snapshot(client, pool)
        from e31.flows.placement import plan

        placements = plan(snap.nodes, snap.running, snap.queued, snap.now, tenancy=snap.tenancy)
        line = submitted_line(snap, placements, str(run.id))
        if line is None:  # ended already (refused by the scheduler, or cancelled): its state says why
            state = client.read_flow_run(run.id).state
            line = f"{state.name}: {state.message or ''}".rstrip(": ")
        note = scheduler_note(client, pool.name, args.pool)
    print(f"submitted {spec.name} for tenant {tenant}: flow run {run.id}")
    print(f"  {line}")
    if note:
        print(f"e31: {note}", file=sys.stderr)
    return EXIT_OK


def cmd_queue(args: argparse.Namespace) -> int:
    from prefect.client.orchestration import get_client

    from e31.deployments.presence import lease_of, scheduler_note
    from e31.deployments.runwords import job_rows, node_lines, print_table
    from e31.deployments.scheduler import snapshot
    from e31.flows.placement import plan
    from e31.flows.queue import LEASE_S
    from e31.prefect_compat import clock

    pool = _pool(args.pool)
    _need_api()
    from e31.deployments.prefetch import progress_of

    with get_client(sync_client=True) as client:
        clock.measure(client)  # heartbeats and leases are judged on the server's clock
        lease_s, serving = lease_of(client, pool.name, LEASE_S)
        note = scheduler_note(client, pool.name, args.pool)
        snap = snapshot(client, pool, lease_s=lease_s)
        snap.scheduler_heard = serving
        placements = plan(snap.nodes, snap.running, snap.queued, snap.now, tenancy=snap.tenancy)
        try:
            staging = progress_of(client, [p.job for p in placements if p.action == "wait"])
        except Exception:  # the progress is a courtesy: the queue is listed without it
            staging = {}
    rows = job_rows(snap, placements, staging)
    print_table(rows)
    print()
    print_table([("NODE", "IN USE", "WORKER"), *node_lines(snap, snap.now, args.pool)])
    if note:
        print(f"e31: {note}", file=sys.stderr)
    if (skew := clock.skew_line()) is not None:
        print(f"e31: {skew}", file=sys.stderr)
    return EXIT_OK
