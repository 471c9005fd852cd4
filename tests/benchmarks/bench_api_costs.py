"""Benchmark: what each Prefect API call of a queued job's life costs the
Prefect server, in CPU milliseconds.

    python tests/benchmarks/bench_api_costs.py [--queued 300] [--calls 100] [--counts DIR]

The live queue's wall time on a small machine is bound by the Prefect
server's CPU (bench_queue.py: ~1.2 CPU-s per 3 s job, one core).  This
benchmark starts its own ``prefect server start`` (SQLite, 127.0.0.1),
creates E31's work pool and ``--queued`` queued flow runs through E31's
submit path, then sends ``--calls`` of each call, one at a time, on an
otherwise idle server, and prints for each the server's CPU time per call
(``/proc/<pid>/stat``: user + system, the whole server process) and the
wall time per call, with the ratio to the baseline, a plain read of one
flow run (``GET /flow_runs/{id}``).  An idle server's own CPU over the same
time is printed first (its services' background work, not a call's).

With ``--counts DIR`` (the folder ``bench_queue.py --count-api DIR``
wrote), it also prints how many of each call a job made there (per job,
by who made it: the scheduler, the workers, the flow processes; resends
after a busy database's 503 included: each costs the server its work
again) and the server CPU per job these costs add up to.

Measured on this 2-core machine (idle, 300 queued): a read 13.5 ms; a
``PATCH /flow_runs/{id}`` with ``job_variables`` 58.6 ms (4.3x: Prefect
reads the run and its deployment and validates the variables against the
work pool's schema inside the write transaction, so a write committed
meanwhile fails it with 503 and it is sent again whole), against 8 ms
without them; a state write 27-40 ms; a label write 14 ms; an artifact
19 ms; a log line 6 ms; a filter returning 300 runs 115 ms.  Priced at
bench_queue's counts (30 jobs), the scheduler's placements as
``job_variables`` (3.3 sends per job: 1 + 2.3 resends after 503) were its
largest item, ~270 ms of server CPU per job; they are the runs'
``placement`` parameter now (one plain update per placement).

Stopped (SIGTERM, Ctrl-C) or failing, it stops its server and removes its
temporary folder, then exits; 143 or 130 after a signal
(``tests/benchmarks/cleanup.py``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from e31.prefect_compat.api import api_ready

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the repository's tests package
    sys.path.insert(0, str(REPO))
from tests.benchmarks.cleanup import Cleanup  # noqa: E402
from tests.benchmarks.server import start_server  # noqa: E402


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of the process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(pid: int, n: int, call: Callable[[int], Any]) -> tuple[float, float]:
    """(server CPU ms per call, wall ms per call) over ``n`` calls of
    ``call(k)``, after a second's pause (the previous batch's events
    settle) and with half a second after (this batch's)."""
    time.sleep(1.0)
    cpu0, wall0 = _cpu_s(pid), time.perf_counter()
    for k in range(n):
        call(k)
    wall = time.perf_counter() - wall0
    time.sleep(0.5)
    return 1000 * (_cpu_s(pid) - cpu0) / n, 1000 * wall / n


def _counts(folder: Path) -> dict[str, collections.Counter]:
    """Calls per job by route and maker, from ``bench_queue.py --count-api``'s files."""
    by: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    jobs = 0
    for path in folder.glob("api.*.json"):
        data = json.loads(path.read_text())
        maker = "flow processes" if data.get("flow_run_id") else " ".join(data["argv"][1:2]) or "other"
        maker = {"scheduler": "scheduler", "worker": "workers"}.get(maker, maker)
        jobs += bool(data.get("flow_run_id"))
        for key, count in data["counts"].items():
            if " @ " not in key and (key.startswith(("GET", "POST", "PATCH", "DELETE", "PUT"))):
                by[maker][key] += count
    return {maker: collections.Counter({k: v / max(jobs, 1) for k, v in c.items()}) for maker, c in by.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=300, help="queued flow runs on the server while it is measured")
    parser.add_argument("--calls", type=int, default=100, help="calls of each kind")
    parser.add_argument("--counts", type=Path, default=None, help="a bench_queue.py --count-api folder")
    args = parser.parse_args()
    with Cleanup("bench_api_costs") as cleanup:  # on any end, a signal too: the server stopped, the folder removed
        root = cleanup.tempdir("e31-bench-api-")
        api, _, server = start_server(root)
        while not api_ready(api):
            time.sleep(0.5)
        return _run(args, server.pid)


def _run(args: argparse.Namespace, pid: int) -> int:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate, LogCreate
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.states import Pending, Running, Scheduled

    from e31.deployments.worker import E31Worker
    from e31.flows.deploy import parameters
    from e31.flows.queue import ensure_pool, submit
    from e31.specs import parse_spec
    from e31.specs.pool import parse_pool

    pool = parse_pool({"pool_version": 1, "name": "bench", "nodes": [
        {"name": "n", "count": 3, "gpus": 0, "cpus": 1, "memory": "1GiB"}]})
    template = E31Worker.get_default_base_job_template()
    n = args.calls
    with get_client(sync_client=True) as client:
        ensure_pool(client, pool, template)
        ids = [str(submit(client, pool, parameters(parse_spec({
            "name": f"job-{i:04d}", "work": {"kind": "simulation", "command": ["true"]},
            "request": {"cpus": 1, "duration": "5s", "limit": "10m"},
            "output": {"kind": "results", "url": f"/tmp/e31-bench-api/{i}", "files": ["r.json"]}}), None), ["e31"],
            template).id) for i in range(max(args.queued, n))]
        now = datetime.now(timezone.utc)
        params = [client.read_flow_run(key).parameters for key in ids[:n]]
        placement = {"e31_node": "n-1", "gpu_devices": [], "cpus": 1, "e31_attempt": 0}
        calls: list[tuple[str, str, Callable[[int], Any], int]] = [
            ("GET /api/flow_runs/{id}", "a read of one flow run (the baseline)", lambda k: client.read_flow_run(ids[k]), n),
            ("PATCH /api/flow_runs/{id}", "a placement: the placement parameter (the scheduler's)",
             lambda k: client.update_flow_run(ids[k], parameters={**params[k], "placement": placement}), n),
            ("PATCH /api/flow_runs/{id}", "a placement as job_variables (the scheduler's until Dec. 2026)",
             lambda k: client.update_flow_run(ids[k], job_variables=placement), n),
            ("POST /api/flow_runs/{id}/set_state", "Scheduled named Placed, with its message",
             lambda k: client.set_flow_run_state(ids[k], Scheduled(name="Placed", message="starts now on n-1"),
                                                 force=True), n),
            ("POST /api/flow_runs/{id}/set_state", "Pending (the worker's)", lambda k: client.set_flow_run_state(
                ids[k], Pending()), n),
            ("POST /api/flow_runs/{id}/set_state", "Running (the flow process's)", lambda k: client.set_flow_run_state(
                ids[k], Running()), n),
            ("PATCH /api/flow_runs/{id}/labels", "the worker's labels", lambda k: client.update_flow_run_labels(
                ids[k], {"prefect.worker.name": "w", "prefect.worker.type": "e31"}), n),
            ("POST /api/artifacts/", "a keyed table artifact (the manifest)", lambda k: client.create_artifact(
                ArtifactCreate(key="manifest", type="table", data=[{"path": "r.json", "bytes": 1}], flow_run_id=ids[k])),
             n),
            ("POST /api/logs/", "one log line", lambda k: client.create_logs([LogCreate(
                name="e31", level=20, message="a line", timestamp=now, flow_run_id=ids[k])]), n),
            ("PATCH /api/flow_runs/{id}", "without job_variables (infrastructure_pid: a worker's)",
             lambda k: client.update_flow_run(ids[k], infrastructure_pid=f"host:{k}"), n),
            ("POST /api/flow_runs/filter", "the runs changed since a moment ago (a tick's read: few)",
             lambda k: client.read_flow_runs(flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                 type=FlowRunFilterStateType(any_=["RUNNING"]))), limit=10), n),
            ("POST /api/flow_runs/filter", f"every queued run ({len(ids)}: a full read)", lambda k: client.read_flow_runs(
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                    any_=["SCHEDULED"])))), max(5, n // 5)),
        ]
        idle_cpu, _ = _measure(pid, 100, lambda k: time.sleep(0.01))
        print(f"server on {len(ids)} queued runs; idle: {idle_cpu:.1f} ms of server CPU per 10 ms (its services)")
        print(f"{'route':40s} {'what':58s} {'CPU ms':>7s} {'wall ms':>8s} {'x read':>7s}")
        cost: dict[str, float] = {}
        base = None
        for route, what, call, count in calls:
            cpu_ms, wall_ms = _measure(pid, count, call)
            base = base or cpu_ms
            cost[f"{route} {what}"] = cpu_ms
            cost.setdefault(route, cpu_ms)
            print(f"{route:40s} {what:58s} {cpu_ms:7.1f} {wall_ms:8.1f} {cpu_ms / base:7.2f}")
    if args.counts:
        # A route's price: the first measured above (the scheduler's PATCH: a placement parameter), except a
        # PATCH without job_variables (the flow processes' and the workers') and a filter as a tick reads it (few
        # runs: the full read is once a minute)
        cheap = {"PATCH /api/flow_runs/{id}": cost["PATCH /api/flow_runs/{id} without job_variables "
                                                   "(infrastructure_pid: a worker's)"],
                 "POST /api/flow_runs/filter": cost["POST /api/flow_runs/filter the runs changed since a moment ago "
                                                    "(a tick's read: few)"]}
        print(f"\nper job in {args.counts} (resends after a 503 included), at the costs above:")
        total = 0.0
        for maker, counter in sorted(_counts(args.counts).items()):
            price = {**cost, **cheap} if maker != "scheduler" else {**cost, "POST /api/flow_runs/filter":
                                                                   cheap["POST /api/flow_runs/filter"]}
            known = {k: v for k, v in counter.items() if k in price}
            ms = sum(v * price[k] for k, v in known.items())
            total += ms
            top = ", ".join(f"{k} {v:.1f}" for k, v in counter.most_common(4))
            print(f"  {maker:16s} {sum(counter.values()):5.1f} calls, {ms:6.0f} ms priced ({top})")
        print(f"  priced in all: {total:.0f} ms of server CPU per job (routes not priced above, and the events the flow "
              "processes send, are left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
