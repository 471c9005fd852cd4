"""Benchmark: multi-node jobs (gangs) in simulated time, E31 against a gang-aware FCFS+EASY.

    python tests/benchmarks/bench_gangs.py [--model lublin|philly] [--jobs 10000] [--load 1.0] [--seed 38]
                                           [--processors 256] [--group 8]
                                           [--trace PHILLY_CSV] [--skip 65000]
                                           [--checkpoint-every 1800] [--restart-cost 60] [--only NAMES]

A job wider than one node of 8 GPUs runs on as few nodes as hold it, an equal share of its GPUs on
each (a 32-GPU job is 4 nodes of 8, a 12-GPU job 2 nodes of 6), all started together or not at all.

* ``--model lublin``: the Lublin-Feitelson model (:mod:`tests.benchmarks.lublin`: rigid parallel jobs
  of 1 to ``--processors`` processors, run times of seconds to 45 hours), each processor a GPU, on
  ``--processors`` / 8 nodes of 8 GPUs in groups (racks) of ``--group`` nodes;
* ``--model philly --trace FILE``: ``--jobs`` jobs of Microsoft's Philly trace from the ``--skip``-th
  by submission time, every job kept, the wide ones as gangs (:mod:`tests.benchmarks.philly` says
  where the file comes from; the window of jobs 65,000-74,999 has 62 jobs over 8 GPUs holding 27% of
  its GPU-hours), on as many nodes of 8 GPUs as make the window offer ``--load``.

Side by side in one run, on the same pool and jobs:

* FCFS+EASY, gang-aware, given every job's exact run time (the planner's ``easy`` policy: the first
  waiting job, a gang or not, holds a reservation on all the nodes it needs; later jobs backfill only
  where they cannot delay it);
* E31 with the same perfect estimates (its default policy);
* E31 as issue 36 runs it: no job declares a duration; single-node jobs checkpoint every
  ``--checkpoint-every`` seconds, are ordered by attained service and preempted; gangs are never
  preempted, so they are planned on their limit.

Printed per replay: jobs run and refused, mean completion (submission to end), maximum wait, the
gangs' mean and maximum wait, utilisation and the replay's own time; then E31's ratios to
FCFS+EASY.  The issue's goal: nothing refused that the pool can hold.
Pure computation: no process, no folder.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the repository's tests package
    sys.path.insert(0, str(REPO))
from tests.benchmarks import lublin, philly  # noqa: E402
from tests.benchmarks.cleanup import Cleanup  # noqa: E402

from e31.flows.placement.model import Node, QueuedJob  # noqa: E402
from e31.flows.placement.preemption import PreemptionRules  # noqa: E402
from e31.flows.placement.simulate import Result, SimJob, simulate  # noqa: E402

GIB = 1024**3
T0 = 1_767_225_600.0  # 2026-01-01T00:00Z
PER_NODE = 8
LIMIT_S = 2 * 86400.0


def spread(width: int, per_node: int = PER_NODE) -> tuple[int, int]:
    """``(nodes, GPUs per node)`` of a job of ``width`` GPUs on nodes of ``per_node``: as few nodes as
    hold it, an equal share on each (rounded up)."""
    nodes = -(-width // per_node)
    return nodes, -(-width // nodes)


def declared(job_id: str, name: str, at: float, width: int, run: float) -> tuple[QueuedJob, float]:
    """A job of ``width`` GPUs submitted at ``at`` that runs ``run`` seconds and declares it exactly."""
    nodes, gpus = spread(width)
    job = QueuedJob(id=job_id, name=name, gpus=gpus, cpus=4 * gpus, memory=32 * GIB * gpus, submitted=round(at),
                    runtime_s=round(run), limit_s=max(LIMIT_S, round(run)), runtime_source="duration", nodes=nodes)
    return job, round(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("lublin", "philly"), default="lublin")
    parser.add_argument("--jobs", type=int, default=10000)
    parser.add_argument("--load", type=float, default=1.0, help="offered load, a share of the pool's GPUs")
    parser.add_argument("--seed", type=int, default=38)
    parser.add_argument("--processors", type=int, default=256, help="--model lublin: the pool's GPUs (a multiple of 8)")
    parser.add_argument("--group", type=int, default=8, help="--model lublin: nodes per group (rack)")
    parser.add_argument("--trace", type=Path, help="the Philly trace's per-job CSV (--model philly)")
    parser.add_argument("--skip", type=int, default=65000, help="--model philly: jobs of the trace to skip first")
    parser.add_argument("--checkpoint-every", type=float, default=1800.0)
    parser.add_argument("--restart-cost", type=float, default=60.0)
    parser.add_argument("--only", default=None, help="replays to run by their names in the table, comma-separated")
    args = parser.parse_args()
    if args.model == "philly" and (args.trace is None or not args.trace.is_file()):
        parser.error("--model philly needs --trace FILE, the Philly trace's per-job CSV "
                     "(tests/benchmarks/philly.py says where to get it)")
    if args.model == "lublin" and (args.processors % PER_NODE or args.processors < PER_NODE):
        parser.error(f"--processors must be a multiple of {PER_NODE}")
    with Cleanup("bench_gangs"):  # nothing to stop; a signal ends it with 128 + its number
        if args.model == "lublin":
            count = args.processors // PER_NODE
            jobs = [declared(f"j{k:05d}", f"job{k}", T0 + at, size, run)
                    for k, (at, size, run) in enumerate(lublin.jobs(args.seed, args.jobs, args.processors, args.load))]
            where = (f"the Lublin-Feitelson model ({args.processors} processors as GPUs) on {count} nodes x "
                     f"{PER_NODE} GPUs in groups of {args.group}")
        else:
            window, _ = philly.jobs(args.trace, args.jobs, args.skip, max_gpus=10**9)
            jobs = [declared(f"p{k:05d}", f"{cluster}-{k}", at, gpus, run)
                    for k, (at, gpus, run, cluster) in enumerate(window)]
            count = philly.nodes_for_load(window, args.load)
            sha = philly.digest(args.trace)
            where = (f"the Philly trace (sha256 {sha[:12]}{'' if sha == philly.SHA256 else ', NOT the documented copy'}) "
                     f"jobs {args.skip:,}-{args.skip + len(jobs) - 1:,}, on {count} nodes x {PER_NODE} GPUs "
                     f"in groups of {args.group}")
        nodes = [Node(f"g{i:03d}", PER_NODE, 64, 512 * GIB, "H100", f"rack{i // args.group}") for i in range(count)]
        gangs = {j.id for j, _ in jobs if j.nodes > 1}
        holdable = sum(1 for j, _ in jobs if j.nodes <= count)
        gpu_hours = sum(j.gpus * j.nodes * run for j, run in jobs) / 3600
        gang_hours = sum(j.gpus * j.nodes * run for j, run in jobs if j.id in gangs) / 3600
        print(f"{len(jobs):,} jobs, {where}, offered load {args.load:g}: {len(gangs)} gangs (up to "
              f"{max((j.nodes for j, _ in jobs), default=1)} nodes) holding {gang_hours / gpu_hours:.0%} of "
              f"{gpu_hours:,.0f} GPU-hours; {len(jobs) - holdable} jobs wider than the pool")
        perfect = [SimJob(j, run) for j, run in jobs]
        undeclared = [SimJob(replace(j, runtime_s=j.limit_s, runtime_source="limit"), run, preemptible=True)
                      for j, run in jobs]
        rules = PreemptionRules(restart_s=args.restart_cost)
        print(f"{'replay':<32} {'ran':>6} {'refused':>7} {'mean compl':>10} {'max wait':>9} "
              f"{'gang wait':>9} {'gang max':>9} {'util':>6} {'sim time':>8}")
        runs: dict[str, Result] = {}
        by_id = {j.id: j for j, _ in jobs}
        for name, policy, replay, kwargs in (
            ("FCFS+EASY (perfect, gangs)", "easy", perfect, {}),
            ("E31 (perfect)", "e31", perfect, {}),
            ("E31, no durations, preemption", "e31", undeclared,
             {"preemption": rules, "checkpoint_every_s": args.checkpoint_every, "restart_cost_s": args.restart_cost}),
        ):
            if args.only is not None and name not in {n.strip() for n in args.only.split(",")}:
                continue
            began = time.perf_counter()
            r = runs[name] = simulate(nodes, replay, policy, **kwargs)
            waits = [r.starts[g] - by_id[g].submitted for g in gangs if g in r.starts]
            print(f"{name:<32} {r.jobs:>6} {r.refused:>7} {r.mean_completion_s / 3600:>9.2f}h "
                  f"{r.max_wait_s / 3600:>8.1f}h {sum(waits) / max(len(waits), 1) / 3600:>8.2f}h "
                  f"{max(waits, default=0.0) / 3600:>8.1f}h {r.utilization:>6.1%} {time.perf_counter() - began:>7.0f}s")
            if r.refused != len(jobs) - holdable:
                print(f"  MISSED {name} refused {r.refused} jobs; only {len(jobs) - holdable} are wider than the pool")
        easy = runs.get("FCFS+EASY (perfect, gangs)")
        for name, r in runs.items():
            if easy is None or r is easy:
                continue
            print(f"  {name} / FCFS+EASY: mean completion {r.mean_completion_s / easy.mean_completion_s:.3f}x, "
                  f"maximum wait {r.max_wait_s / max(easy.max_wait_s, 1.0):.3f}x, utilisation "
                  f"{(r.utilization - easy.utilization) * 100:+.1f} pt")


if __name__ == "__main__":
    main()
