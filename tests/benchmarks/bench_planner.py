"""Benchmark: the placement planner on a 1,000-GPU pool (125 nodes x 8 GPUs, 64 CPUs, 512 GiB each).

    python tests/benchmarks/bench_planner.py [--seed 31] [--jobs 10000] [--policies fcfs,easy,edf,e31]
    python tests/benchmarks/bench_planner.py --plan-only --jobs 100000 --nodes 1250 --policies e31

1. The time of one full plan of 10,000 queued jobs on the pool with every
   node busy (target: under 1 s on a 2-core machine).
2. A simulated week: 10,000 jobs from a fixed seed replayed, the same jobs for
   every policy, through FCFS, FCFS+EASY, EDF (deadline first, EASY
   backfilling) and E31: deadlines met, utilisation, average bounded slowdown,
   maximum wait; then the targets, met or missed:
   E31 meets at least as many deadlines as EDF and at least 99% of those
   feasible on an empty pool; utilisation at least FCFS+EASY's; average
   bounded slowdown at most half FCFS+EASY's; maximum wait at most 1.5x
   FCFS+EASY's.

The workload (``week``): arrivals over the first five days, a Poisson process
whose rate follows the day (busiest at 14:00 UTC, a third as busy at 02:00);
1-8 GPUs (mostly 1, 2, 4, 8) with 8 CPUs and 64 GiB per GPU; a declared
duration log-uniform from 5 minutes to 24 hours and a limit of 1.5x it; the
actual run time 30-105% of the duration (one job in six overruns its estimate,
never its limit); staging 0-5 minutes; a third of the jobs with a deadline:
most with 1-12 hours of slack beyond duration + staging, one in eight tight
(6-60 minutes of slack), one in twenty-five infeasible even on an empty pool.
The planner sees only what a job declares (duration, limit, deadline).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

from e31.flows.placement import Node, QueuedJob, RunningJob, plan
from e31.flows.placement.simulate import SimJob, simulate

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the repository's tests package
    sys.path.insert(0, str(REPO))
from tests.benchmarks.cleanup import Cleanup  # noqa: E402

GIB = 1024**3
DAY = 86400.0
T0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC
ARRIVAL_DAYS = 5.0
SWING = 0.9  # arrivals at 14:00 UTC are 19x as frequent as at 02:00
NAMES = {"fcfs": "FCFS", "easy": "FCFS+EASY", "edf": "EDF", "e31": "E31"}


def pool(count: int = 125) -> list[Node]:
    """``count`` nodes x 8 H100, 64 CPUs, 512 GiB."""
    return [Node(f"n{i:04d}", 8, 64, 512 * GIB, "H100") for i in range(1, count + 1)]


def _arrival(rng: random.Random, t: float, rate: float) -> float:
    """The next arrival after ``t`` of a Poisson process with a daily cycle (thinning)."""
    peak = rate * (1 + SWING)
    while True:
        t += rng.expovariate(peak)
        hour = (t - T0) % DAY / 3600
        if rng.random() < (1 + SWING * math.cos((hour - 14) / 24 * 2 * math.pi)) / (1 + SWING):
            return t


def week(seed: int, count: int, days: float = ARRIVAL_DAYS) -> list[SimJob]:
    """``count`` jobs arriving over ``days`` days from ``seed`` (see the module docstring)."""
    rng = random.Random(seed)
    jobs, t = [], T0
    rate = count / (days * DAY)
    for k in range(count):
        t = _arrival(rng, t, rate)
        gpus = rng.choices([1, 2, 3, 4, 5, 6, 7, 8], weights=[30, 18, 3, 22, 2, 3, 2, 20])[0]
        duration = round(math.exp(rng.uniform(math.log(300), math.log(DAY))))
        limit = math.ceil(duration * 1.5)
        actual = min(duration * rng.uniform(0.3, 1.05), limit)
        staging = round(rng.uniform(0, 300))
        deadline = None
        if rng.random() < 1 / 3:
            kind = rng.random()
            if kind < 0.04:
                slack = -rng.uniform(60, 3600)  # infeasible: refused at submission
            elif kind < 0.16:
                slack = rng.uniform(360, 3600)  # tight
            else:
                slack = rng.uniform(3600, 12 * 3600)
            deadline = t + staging + duration + slack
        job = QueuedJob(id=f"j{k:05d}", name=f"job{k % 500}", gpus=gpus, cpus=8 * gpus, memory=64 * GIB * gpus,
                        gpu_type="H100", submitted=round(t), deadline=deadline and round(deadline),
                        staging_s=staging, runtime_s=duration, limit_s=limit, runtime_source="duration")
        jobs.append(SimJob(job, actual))
    return jobs


def busy_pool(nodes: list[Node], rng: random.Random, now: float) -> list[RunningJob]:
    """Running jobs filling every GPU of every node, ending 5 minutes to 24 hours from ``now``."""
    running = []
    for node in nodes:
        free = 0
        while free < node.gpus:
            g = min(rng.choice([1, 2, 4, 8]), node.gpus - free)
            end = now + math.exp(rng.uniform(math.log(300), math.log(DAY)))
            running.append(RunningJob(f"r{len(running)}", node.name, tuple(range(free, free + g)), 8 * g, 64 * GIB * g,
                                      now - 600, end))
            free += g
    return running


def full_plan(seed: int, count: int, node_count: int = 125, policies: tuple[str, ...] = ("e31", "easy", "fcfs"),
              repeat: int = 3) -> None:
    """Time one plan of ``count`` queued jobs on a busy pool of ``node_count`` nodes, per policy (median
    of ``repeat``), and the process's peak resident memory (``ru_maxrss``) after them."""
    import resource

    nodes, rng = pool(node_count), random.Random(seed + 1)
    jobs = [s.job for s in week(seed, count)]
    now = max(j.submitted for j in jobs)
    jobs = [j if j.deadline is None else QueuedJob(**{**j.__dict__, "deadline": now + (j.deadline - j.submitted)})
            for j in jobs]
    running = busy_pool(nodes, rng, now)
    print(f"one full plan: {len(jobs):,} queued jobs, {len(running)} running, {len(nodes)} nodes x 8 GPUs")
    for policy in policies:
        times = []
        for _ in range(repeat):
            began = time.perf_counter()
            placements = plan(nodes, running, jobs, now, policy)
            times.append(time.perf_counter() - began)
        times.sort()
        starts = sum(p.action == "start" for p in placements)
        middle = times[len(times) // 2]
        mark = "met" if middle < 1.0 else "MISSED"
        print(f"  {NAMES[policy]:<10} {middle:6.3f} s  ({starts} start now)  target < 1 s: {mark}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux
    print(f"  peak resident memory of this process: {peak:.2f} GiB")


def compare(seed: int, count: int, policies: list[str]) -> None:
    """Replay the week under each policy and check the targets."""
    nodes, jobs = pool(), week(seed, count)
    work = sum(s.job.gpus * (s.job.staging_s + s.actual_s) for s in jobs)
    print(f"\nsimulated week: {count:,} jobs, offered load {work / (1000 * 5 * DAY):.0%} of the pool over the 5 "
          "days of arrivals")
    header = f"{'policy':<10} {'deadlines met':>16} {'utilisation':>11} {'avg bsld':>9} {'max wait':>9} {'avg wait':>9} {'refused':>7} {'sim time':>8}"
    print(header)
    results = {}
    for policy in policies:
        began = time.perf_counter()
        r = simulate(nodes, jobs, policy)
        results[policy] = r
        print(f"{NAMES[policy]:<10} {r.deadlines_met:>6}/{r.deadlines_feasible:<4}({r.deadlines_total:>4}) "
              f"{r.utilization:>11.1%} {r.avg_bounded_slowdown:>9.2f} {r.max_wait_s / 3600:>8.1f}h "
              f"{r.avg_wait_s / 3600:>8.2f}h {r.refused:>7} {time.perf_counter() - began:>7.0f}s")
    print("(deadlines met / feasible on an empty pool (all with a deadline))")
    if not {"e31", "easy", "edf"} <= set(results):
        return
    e31, easy, edf = results["e31"], results["easy"], results["edf"]
    checks = [
        ("E31 deadlines met >= EDF's", e31.deadlines_met >= edf.deadlines_met,
         f"{e31.deadlines_met} vs {edf.deadlines_met}"),
        ("E31 deadlines met >= 99% of feasible", e31.deadlines_met >= 0.99 * e31.deadlines_feasible,
         f"{e31.deadlines_met / max(e31.deadlines_feasible, 1):.1%}"),
        ("E31 utilisation >= FCFS+EASY's", e31.utilization >= easy.utilization,
         f"{e31.utilization:.2%} vs {easy.utilization:.2%}"),
        ("E31 avg bounded slowdown <= 1/2 FCFS+EASY's", e31.avg_bounded_slowdown <= easy.avg_bounded_slowdown / 2,
         f"{e31.avg_bounded_slowdown:.2f} vs {easy.avg_bounded_slowdown:.2f}"),
        ("E31 max wait <= 1.5x FCFS+EASY's", e31.max_wait_s <= 1.5 * easy.max_wait_s,
         f"{e31.max_wait_s / 3600:.1f}h vs {easy.max_wait_s / 3600:.1f}h"),
    ]
    for text, ok, numbers in checks:
        print(f"  {'met   ' if ok else 'MISSED'} {text}: {numbers}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--policies", default="fcfs,easy,edf,e31")
    parser.add_argument("--skip-full-plan", action="store_true")
    parser.add_argument("--nodes", type=int, default=125, help="the full plan's pool: nodes of 8 GPUs")
    parser.add_argument("--plan-only", action="store_true", help="only the full plan (timed once per policy in "
                        "--policies), no simulated week: e.g. --jobs 100000 --nodes 1250 --policies e31")
    args = parser.parse_args()
    with Cleanup("bench_planner"):  # nothing to stop (no process, no folder); a signal ends it with 128 + its number
        if args.plan_only:
            full_plan(args.seed, args.jobs, args.nodes, tuple(args.policies.split(",")), repeat=1)
            return
        if not args.skip_full_plan:
            full_plan(args.seed, args.jobs, args.nodes)
        compare(args.seed, args.jobs, args.policies.split(","))


if __name__ == "__main__":
    main()
