"""Benchmark: the live queue on a real Prefect server with real workers.

    python tests/benchmarks/bench_queue.py [--jobs 1000] [--nodes 3] [--work-s 3] [--handover 10] [--no-run]
                                           [--database sqlite|postgresql]

Starts its own ``prefect server start`` (SQLite, 127.0.0.1; with ``--database postgresql`` on a private
PostgreSQL cluster it starts, :mod:`tests.pgserver`), ``e31 scheduler``
and one ``e31 worker`` per node (each 1 CPU slot), then:

1. **submit rate**: creates the queued flow runs of ``--jobs`` short jobs
   through E31's submit path (jobs/s);
2. **scheduler cycle with a full queue**: before any worker starts, the
   first tick (which writes every waiting job's reason), then the ticks of
   the service as it runs them (read what changed, plan, write within the
   service's write budget) with ``--jobs`` jobs queued, in seconds (target
   < 1 s);
3. **release to start**: for each job, seconds from its placement (the
   ``Placed`` state; for a run handed over behind another, the end of the
   job ahead, when its resources became its own) to its work's first line
   (median and p95; target p95 < 5 s);
4. **total wall against the ideal**: from the first placement to the last
   job's end, against the sum of the works' seconds divided by the pool's
   slots (target <= 1.3x);
5. **stagings saved by locality**: each job reads one of ``--inputs`` input
   files (1 MiB each); the runs whose manifest says their inputs were
   found staged (``staged_before_allocation``).  Each job here has its own
   name, and a job's staged copies live in its own scratch folder, so none
   is expected: locality pays off for later runs of the same job
   (``tests/deployments/test_queue.py``) and for prefetch
   (``bench_prefetch.py``).

Then, unless ``--no-baseline``, the **baseline**: the same jobs as a
hand-written plain Prefect flow (stage, run, put) on a ``process`` work
pool with one ``prefect worker start --type process --limit 1`` per node
(``queue_baseline.py``), on the same server once E31's scheduler and
workers have stopped; it prints its wall against the ideal, its CPU per
job, and E31 / baseline for both.

Each job is a command work sleeping ``--work-s`` seconds.  Every job also
costs a flow run's life on the Prefect server (its states, task runs, logs
and artifacts) and a flow process forked from the worker's warm process:
~2 s of latency, which the scheduler's handover (``--handover``) hides
behind the job ahead, and ~2.2 CPU-seconds of the whole machine (the
server's part, ~1.0, on one core; 2.4-2.7 and 1.2-1.5 before the placement
was a parameter, December 2026), which nothing hides.  The run prints the
machine's CPU per job and the least wall that CPU allows: on a 2-core
machine with 3 s jobs it is ~1.1x the ideal (run it with 3 and with 10).
The idle gap between two works on a node is also split where the job
ahead's final manifest reached its destination (its output returned).  Load widens
that gap: on a machine loaded 13-23 by other work, consecutive 6-GPU jobs on a node were
10-45 s apart (0.21 s median here, idle), as the job behind's flow process, staging and
child start, each slowed by the starved CPU, outlast the ``--handover`` lead; measure it
under the load the pool will have.  1,000 jobs of 3 s take about 25 min (4 of them submitting);
150 jobs about 5.

Stopped (SIGTERM, Ctrl-C) or failing, it stops everything it started (the
server, the scheduler, the workers, their flow processes and works, the
baseline's workers) and removes its temporary folder (kept with ``--keep``),
then exits; 143 or 130 after a signal (``tests/benchmarks/cleanup.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from e31.prefect_compat.api import api_ready

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the repository's tests package
    sys.path.insert(0, str(REPO))
from tests.benchmarks.cleanup import Cleanup, spawn  # noqa: E402

WORK = ("import json, os, pathlib, sys, time; t = time.time(); time.sleep(float(sys.argv[1])); "
        "pathlib.Path(os.environ['E31_OUTPUT_DIR'], 'r.json').write_text(json.dumps({'start': t, 'end': time.time()}))")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu() -> tuple[float, float, float] | None:
    """(busy, total, stolen) CPU-seconds of the whole machine since boot,
    from /proc/stat (None elsewhere); ``stolen``: the time a virtual
    machine's host gave its CPUs to others (counted in ``busy``: the
    machine could not run then)."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    steal = fields[7] if len(fields) > 7 else 0.0
    return (sum(fields[:8]) - idle) / tick, sum(fields[:8]) / tick, steal / tick


def _tree_cpu(pid: int) -> float:
    """CPU-seconds of process ``pid`` and of its descendants, live ones and
    those reaped (``cutime``/``cstime``), from /proc (0.0 once gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        own = sum(float(x) for x in fields[11:15]) / tick  # utime, stime, cutime, cstime
        kids = [int(k) for t in Path(f"/proc/{pid}/task").iterdir()
                for k in (t / "children").read_text().split()]
    except (OSError, ValueError):
        return 0.0
    return own + sum(_tree_cpu(k) for k in kids)


def main() -> int:
    with Cleanup("bench_queue") as cleanup:
        return _main(cleanup)


def _main(cleanup: Cleanup) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--work-s", type=float, default=3.0)
    parser.add_argument("--inputs", type=int, default=6, help="distinct input files the jobs read (locality)")
    parser.add_argument("--handover", type=float, default=10.0,
                        help="the scheduler's --handover seconds (0: every run starts only once its resources are free)")
    parser.add_argument("--interval", type=float, default=2.0,
                        help="the scheduler's --interval seconds (default: e31 scheduler's own; it is woken by each "
                             "run's end and each submission anyway: 150 jobs at 0.5 s cost 2.46 CPU-s per job, 1.51x, "
                             "against 2.26 and 1.49x at 2 s)")
    parser.add_argument("--poll", type=float, default=None,
                        help="the workers' PREFECT_WORKER_QUERY_SECONDS (default: e31 worker's own)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, scratch, outputs)")
    parser.add_argument("--no-run", action="store_true", help="measure submit and the scheduler cycle only")
    parser.add_argument("--count-api", metavar="DIR", default=None,
                        help="count (and time) every process's Prefect API calls into DIR (tests/benchmarks/apicount; "
                             "E31_BENCH_TRACE_MARKS names E31 functions to time too); implies --keep")
    parser.add_argument("--database", choices=("sqlite", "postgresql"), default="sqlite",
                        help="the Prefect server's database: SQLite (Prefect's default) or a private PostgreSQL "
                             "cluster the benchmark starts (tests/pgserver.py: Debian's postgresql, run as root)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the baseline (the same jobs on plain Prefect: tests/benchmarks/queue_baseline.py)")
    args = parser.parse_args()
    root = cleanup.tempdir("e31-bench-queue-", keep=bool(args.keep or args.count_api))
    port = _port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(root / "home"), "PREFECT_API_URL": api, "PREFECT_UI_ENABLED": "false",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "PREFECT_LOGGING_LEVEL": "WARNING",
           "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL"}
    if args.count_api:
        Path(args.count_api).mkdir(parents=True, exist_ok=True)
        args.keep = True
        env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).with_name("apicount")),
                                                                  os.environ.get("PYTHONPATH")])),
                    "E31_BENCH_API_CALLS": str(Path(args.count_api).resolve() / "api"), "E31_BENCH_API_TRACE": "1",
                    "E31_BENCH_API_WHERE": "1"})
    if args.database == "postgresql":
        from contextlib import ExitStack

        from tests.pgserver import postgres, unavailable

        if unavailable():
            parser.error(f"--database postgresql: {unavailable()}")
        stack = ExitStack()  # stopped at the end; on a signal the Cleanup kills its processes (they carry its mark)
        pg = stack.enter_context(postgres())
        cleanup.folder(pg.root)
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = pg.url
        print(f"database: PostgreSQL, a private cluster on 127.0.0.1:{pg.port}")
        try:
            return _serve(args, root, env, cleanup, port, api)
        finally:
            stack.close()
    return _serve(args, root, env, cleanup, port, api)


def _serve(args, root: Path, env: dict, cleanup: Cleanup, port: int, api: str) -> int:
    os.environ.update(env)
    if args.keep:
        print(f"kept: {root}")
    # The server is stopped last, once the scheduler and the workers have made their last calls (with the server
    # gone first, a worker spent ~2 min retrying: a next bench's CPU); the Cleanup stops all of them, and the flow
    # processes and works still running, on any end (tests/benchmarks/cleanup.py)
    procs = [spawn([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                   server=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    while not api_ready(api):
        time.sleep(0.5)
    return _run(args, root, env, procs, cleanup)


def _run(args, root: Path, env: dict, procs: list, cleanup: Cleanup) -> int:
    from prefect.client.orchestration import get_client

    from e31.deployments.scheduler import MAX_WAIT_S, MAX_WAITS, tick
    from e31.deployments.worker import E31Worker
    from e31.flows.deploy import parameters
    from e31.flows.queue import AFTER_VAR, NODE_VAR, RunCache, ensure_pool, placement_of, submit
    from e31.specs import parse_spec
    from e31.specs.pool import parse_pool

    pool = parse_pool({"pool_version": 1, "name": "bench", "nodes": [
        {"name": "n", "count": args.nodes, "gpus": 0, "cpus": 1, "memory": "1GiB"}]})
    (root / "pool.yaml").write_text(json.dumps(pool.model_dump(mode="json")))
    template = E31Worker.get_default_base_job_template()
    inputs = []
    for k in range(args.inputs):
        inputs.append(root / "inputs" / f"in-{k}.bin")
        inputs[-1].parent.mkdir(parents=True, exist_ok=True)
        inputs[-1].write_bytes(os.urandom(2**20))
    specs = [parse_spec({"name": f"job-{i:04d}", "data": [{"name": "in", "url": str(inputs[i % len(inputs)])}],
                         "work": {"kind": "simulation", "command": [
        sys.executable, "-c", WORK, str(args.work_s)]}, "request": {"cpus": 1, "duration": f"{args.work_s + 2}s",
        "limit": "10m"}, "output": {"kind": "results", "url": str(root / "out" / f"job-{i:04d}"), "files": ["r.json"]}})
             for i in range(args.jobs)]
    with get_client(sync_client=True) as client:
        ensure_pool(client, pool, template)
        started = time.perf_counter()
        ids = [str(submit(client, pool, parameters(s, None), ["e31"], template).id) for s in specs]
        submit_s = time.perf_counter() - started
        print(f"submit: {args.jobs} jobs in {submit_s:.1f} s = {args.jobs / submit_s:.1f} jobs/s")
        cache = RunCache(pool)
        cycle = tick(client, pool, cache=cache)  # no worker yet: every job waits; a full tick with the whole queue
        print(f"  (first tick: {cycle.counts})")
        budget = {"max_waits": MAX_WAITS, "max_wait_s": MAX_WAIT_S}  # as e31 scheduler runs its ticks
        full = [tick(client, pool, **budget).cycle_s for _ in range(3)]  # every active run read, as at a full read
        steady = [tick(client, pool, cache=cache, **budget) for _ in range(5)]  # the service's ticks: changes only
        assert not any(t.full for t in steady)
        median = statistics.median(t.cycle_s for t in steady)
        writes = sum(t.counts["wait"] for t in steady)
        kept = sum(t.counts["kept"] + t.counts["deferred"] for t in steady)
        print(f"scheduler cycle with {cycle.queued} queued: first {cycle.cycle_s:.2f} s (writes every reason); "
              f"then {median:.2f} s (median of 5; read {statistics.median(t.read_s for t in steady):.2f} s, plan "
              f"{statistics.median(t.plan_s for t in steady) * 1000:.0f} ms; {writes} reasons rewritten in the 5 "
              f"ticks, {kept} left for later: the service's write budget, e31.deployments.scheduler.MAX_WAITS and "
              f"MAX_WAIT_S, and the deep queue's pace, e31.flows.queue.pace)   target < 1 s: "
              f"{'met' if median < 1 else 'missed'}")
        print(f"  a tick reading every active run (the scheduler's full read, once a minute): "
              f"{statistics.median(full):.2f} s (median of 3)")
        if args.no_run:
            return 0
    exe = str(Path(sys.executable).with_name("e31"))
    t0, cpu0, server0 = time.time(), _cpu(), _tree_cpu(procs[0].pid)
    procs.append(spawn([exe, "scheduler", "--pool", str(root / "pool.yaml"), "--interval", str(args.interval),
                        "--handover", str(args.handover)], env=env, stdout=open(root / "scheduler.log", "wb"),
                       stderr=subprocess.STDOUT))
    for i, (node, _) in enumerate(pool.node_lines(), 1):  # n-1 .. n-N; a single node is named n
        procs.append(spawn([exe, "worker", "--pool", str(root / "pool.yaml"), "--node", node],
                           env={**env, "E31_SCRATCH": str(root / f"scratch-{i}"),
                                **({"PREFECT_WORKER_QUERY_SECONDS": str(args.poll)} if args.poll else {})},
                           stdout=open(root / f"worker-{i}.log", "wb"), stderr=subprocess.STDOUT))
    done = lambda: sum((root / "out" / s.name / "r.json").exists() for s in specs)  # noqa: E731
    while done() < len(specs):
        time.sleep(1)
        if time.time() - t0 > 3600 * 3:
            print("gave up after 3 h")
            break
    cpu1, ran_s = _cpu(), time.time() - t0
    per = {"server": _tree_cpu(procs[0].pid) - server0, "scheduler": _tree_cpu(procs[1].pid),
           "workers and their flow processes": sum(_tree_cpu(p.pid) for p in procs[2:])}
    with get_client(sync_client=True) as client:
        latencies, first_placed, local, slots, finals, handed = [], None, 0, {}, {}, 0
        slowest: list[tuple] = []  # (seconds, run name, node, handed over, [(state, seconds after release)])
        history = {key: client.read_flow_run_states(key) for key in ids}
        for key, states in history.items():
            finals[key] = next((s.timestamp.timestamp() for s in states if s.type.value == "COMPLETED"), None)
        for key in ids:
            states = history[key]
            placed = next((s.timestamp.timestamp() for s in states if s.name == "Placed"), None)
            final = finals[key]
            local += any(s.name == "Placed" and "inputs already staged there" in (s.message or "") for s in states)
            run = client.read_flow_run(key)
            record = root / "out" / run.name / "r.json"
            placement = placement_of(run)
            ahead = placement.get(AFTER_VAR)
            if placed and ahead:  # handed over: its resources were released to it when the job ahead ended
                handed += 1
                placed = max(placed, finals.get(ahead) or client.read_flow_run(ahead).state.timestamp.timestamp())
            if placed and record.exists():
                times = json.loads(record.read_text())
                latencies.append(times["start"] - placed)
                slowest.append((times["start"] - placed, run.name, placement.get(NODE_VAR),
                                bool(ahead), [(s.name, round(s.timestamp.timestamp() - placed, 2)) for s in states
                                              if s.timestamp.timestamp() >= placed - 0.5]))
                first_placed = placed if first_placed is None else min(first_placed, placed)
                node = placement.get(NODE_VAR)
                manifest = root / "out" / run.name / "manifest.json"
                returned = manifest.stat().st_mtime if manifest.exists() else None
                slots.setdefault(node, []).append((placed, times["start"], times["end"], final, returned))
    ends = [json.loads((root / "out" / s.name / "r.json").read_text())["end"] for s in specs
            if (root / "out" / s.name / "r.json").exists()]
    latencies.sort()
    p95 = latencies[max(0, int(0.95 * len(latencies)) - 1)]
    print(f"release to start: median {statistics.median(latencies):.2f} s, p95 {p95:.2f} s   target p95 < 5 s: "
          f"{'met' if p95 < 5 else 'missed'}  ({handed} of {len(ids)} runs handed over behind the job ahead: "
          f"released when it ended)")
    for seconds, name, node, handed_over, states in sorted(slowest, reverse=True)[:3]:
        print(f"  slow release: {name} on {node} {seconds:.2f} s ({'handed over' if handed_over else 'placed'}); "
              f"states, seconds after its release: {', '.join(f'{n} {t:+.2f}' for n, t in states)}")
    ends_to_final, final_to_placed, end_to_returned, returned_to_start = [], [], [], []
    for runs in slots.values():  # one job at a time per node: each gap between two runs on a node
        runs.sort()
        for (_, _, end, final, returned), (placed, start, _, _, _) in zip(runs, runs[1:]):
            if final is not None:
                ends_to_final.append(final - end)
                final_to_placed.append(placed - final)
            if returned is not None:
                end_to_returned.append(returned - end)
                returned_to_start.append(start - returned)
    idle = sorted(b[1] - a[2] for runs in slots.values() for a, b in zip(runs, runs[1:]))
    if idle:  # what the wall loses against the ideal on each node: the time between one work's end and the next's start
        print(f"a node idle between two works (one's end to the next's start): median {statistics.median(idle):.2f} s, "
              f"p95 {idle[max(0, int(0.95 * len(idle)) - 1)]:.2f} s, in all {sum(idle):.0f} s on {len(slots)} nodes "
              f"({sum(idle) / len(slots):.0f} s of each node's wall)")
    if ends_to_final:
        print(f"a node's slot between two jobs (medians): work end -> flow run Completed "
              f"{statistics.median(ends_to_final):.2f} s, Completed -> next Placed "
              f"{statistics.median(final_to_placed):.2f} s (negative: handed over before it), release -> work start "
              f"{statistics.median(latencies):.2f} s")
    if end_to_returned:  # the idle gap, split where the job ahead's final manifest reached its destination
        print(f"  the idle gap split (medians): work end -> its output returned (final manifest at the destination) "
              f"{statistics.median(end_to_returned):.2f} s, output returned -> the next work's start "
              f"{statistics.median(returned_to_start):.2f} s")
    wall = max(ends) - first_placed
    ideal = len(specs) * args.work_s / args.nodes
    print(f"total wall {wall:.1f} s against the ideal {ideal:.1f} s (work / slots): {wall / ideal:.2f}x   "
          f"target <= 1.3x: {'met' if wall / ideal <= 1.3 else 'missed'}")
    busy_s, cores = ((cpu1[0] - cpu0[0]) if cpu0 and cpu1 else 0.0), os.cpu_count() or 1
    if busy_s:
        print(f"CPU while the jobs ran (the whole machine: server, scheduler, workers, flow processes; the works "
              f"only sleep): {busy_s:.0f} CPU-s in {ran_s:.0f} s on {cores} cores = {100 * busy_s / (ran_s * cores):.0f} "
              f"% busy; {busy_s / len(specs):.2f} CPU-s per job, so {cores} cores run at most "
              f"{cores * len(specs) / busy_s:.2f} jobs/s: a wall of at least {busy_s / cores:.1f} s "
              f"({busy_s / cores / ideal:.2f}x the ideal); of the busy CPU-s, {cpu1[2] - cpu0[2]:.1f} were taken by "
              "the virtual machine's host (steal)")
        print("  CPU-s per job by process (the server: while the jobs ran; the others: since each started): " +
              ", ".join(f"{name} {seconds / len(specs):.2f}" for name, seconds in per.items()))
    cycles = [(float(m.group(2)), m.group(1)) for m in re.finditer(r"read \d+ ms (\w+), plan \d+ ms, cycle (\d+) ms",
                                                                   (root / "scheduler.log").read_text())]
    if cycles:
        ms = sorted(c for c, _ in cycles)
        print(f"scheduler ticks that changed something while the jobs ran: {len(ms)}, cycle median "
              f"{ms[len(ms) // 2]:.0f} ms, p95 {ms[max(0, int(0.95 * len(ms)) - 1)]:.0f} ms, max {ms[-1]:.0f} ms "
              f"({sum(kind == 'full' for _, kind in cycles)} with a full read)")
    failed = re.findall(r"tick failed \((\w+)", (root / "scheduler.log").read_text())
    print(f"scheduler ticks that failed (each then reads every active run again): {len(failed)}"
          + (f" ({', '.join(sorted(set(failed)))}; see scheduler.log with --keep)" if failed else ""))
    resent = sum(int(n) for n in re.findall(r"(\d+) request\(s\) sent again", (root / "scheduler.log").read_text()))
    print(f"scheduler requests sent again after a busy database's 503 (e31.prefect_compat.busy): {resent}")
    reused = sum(1 for s in specs if (root / "out" / s.name / "manifest.json").exists() and json.loads(
        (root / "out" / s.name / "manifest.json").read_text()).get("staged_before_allocation"))
    print(f"stagings saved by locality: {reused} of {len(specs)} runs found their inputs staged (manifest "
          f"staged_before_allocation); {local} placed with 'inputs already staged there'.  Each job is its own, and "
          f"a job's copies live in its own scratch folder: only a later run of the same job reuses them")
    if args.no_baseline:
        return 0
    for proc in procs[1:]:  # E31's scheduler and workers end: the baseline has the machine to itself
        cleanup.stop_group(proc, grace=60)
    from queue_baseline import run_baseline

    base = run_baseline(len(specs), args.nodes, args.work_s, WORK, inputs, root, env, procs[0].pid, _tree_cpu, _cpu)
    print(f"baseline, plain Prefect (the same {len(specs)} jobs as a hand-written flow of 3 tasks on a process work "
          f"pool, one Prefect process worker per node, --limit 1, 1 s poll; no placement): wall {base['wall_s']:.1f} s "
          f"= {base['wall_s'] / ideal:.2f}x the ideal; {base['busy_s'] / len(specs):.2f} CPU-s per job (server "
          f"{base['server_s'] / len(specs):.2f}, workers and their flow processes "
          f"{base['workers_s'] / len(specs):.2f}); steal {base['steal_s']:.1f} CPU-s")
    if busy_s and base["busy_s"]:
        print(f"E31 / plain Prefect: wall {wall / base['wall_s']:.2f}, CPU per job {busy_s / base['busy_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
