"""Benchmark: preemption for deadline jobs, in simulated time, against the same replay without it.

    python tests/benchmarks/bench_preemption.py [--seed 31] [--jobs 2000] [--checkpoint-every 1800]
                                                [--restart-cost 120] [--min-run 600]

The workload is ``bench_planner.py``'s week (a third of the jobs with a deadline, one in eight of
those tight), ``--jobs`` of them arriving at the week's rate, on ``--nodes`` nodes of 8 GPUs (the
week's pool is 125; fewer nodes for the same arrivals make a busy pool, where deadlines compete).  Every job declares its duration.  Jobs without a deadline checkpoint every
``--checkpoint-every`` seconds of work and so are preemptible (``request.preemptible``'s default);
deadline jobs never are.  Side by side in one run: FCFS+EASY, E31 without preemption, E31 with it
(``e31 simulate --checkpoint-every``).  Printed: deadlines met, utilisation, average bounded slowdown,
mean completion, maximum wait, preemptions, and the GPU-hours preemption lost as a share of all
GPU-hours run (target: at most 1%), with the ratios of E31 with preemption to the two others.
Pure computation: no process, no folder.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the repository's tests package
    sys.path.insert(0, str(REPO))
from tests.benchmarks.bench_planner import ARRIVAL_DAYS, pool, week  # noqa: E402
from tests.benchmarks.cleanup import Cleanup  # noqa: E402

from e31.flows.placement.preemption import PreemptionRules  # noqa: E402
from e31.flows.placement.simulate import SimJob, simulate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--checkpoint-every", type=float, default=1800.0, help="seconds of work between checkpoints")
    parser.add_argument("--restart-cost", type=float, default=120.0, help="seconds a preempted job's restart costs")
    parser.add_argument("--min-run", type=float, default=600.0, help="the pool's preemption min_run, seconds")
    parser.add_argument("--nodes", type=int, default=25, help="nodes of 8 GPUs (the week's 125 scaled to the jobs)")
    args = parser.parse_args()
    with Cleanup("bench_preemption"):  # nothing to stop; a signal ends it with 128 + its number
        nodes = pool()[:args.nodes]
        jobs = [SimJob(s.job, s.actual_s, preemptible=s.job.deadline is None)
                for s in week(args.seed, args.jobs, ARRIVAL_DAYS * args.jobs / 10_000)]
        rules = PreemptionRules(args.min_run, None)
        runs = {}
        print(f"{args.jobs:,} jobs on {len(nodes)} nodes x 8 GPUs; checkpoints every {args.checkpoint_every:g} s, "
              f"restart {args.restart_cost:g} s, min_run {args.min_run:g} s")
        print(f"{'replay':<22} {'deadlines met':>14} {'util':>6} {'avg bsld':>9} {'mean compl':>10} {'max wait':>9} "
              f"{'preempt':>7} {'lost GPU-h':>10} {'sim time':>8}")
        for name, policy, kwargs in (
            ("FCFS+EASY", "easy", {}),
            ("E31, no preemption", "e31", {}),
            ("E31, preemption", "e31", {"preemption": rules, "checkpoint_every_s": args.checkpoint_every,
                                        "restart_cost_s": args.restart_cost}),
        ):
            began = time.perf_counter()
            r = simulate(nodes, jobs, policy, **kwargs)
            runs[name] = r
            print(f"{name:<22} {r.deadlines_met:>6}/{r.deadlines_feasible:<7} {r.utilization:>6.1%} "
                  f"{r.avg_bounded_slowdown:>9.2f} {r.mean_completion_s / 3600:>9.2f}h {r.max_wait_s / 3600:>8.1f}h "
                  f"{r.preemptions:>7} {r.lost_gpu_hours:>10.1f} {time.perf_counter() - began:>7.0f}s")
        with_, without, easy = runs["E31, preemption"], runs["E31, no preemption"], runs["FCFS+EASY"]
        gpu_hours = sum(s.job.gpus * s.actual_s for s in jobs) / 3600
        share = with_.lost_gpu_hours / gpu_hours
        print(f"ratios, E31 with preemption to E31 without / to FCFS+EASY: deadlines met "
              f"{with_.deadlines_met / max(without.deadlines_met, 1):.3f} / {with_.deadlines_met / max(easy.deadlines_met, 1):.3f}; "
              f"mean completion {with_.mean_completion_s / without.mean_completion_s:.3f} / "
              f"{with_.mean_completion_s / easy.mean_completion_s:.3f}; utilisation "
              f"{with_.utilization - without.utilization:+.1%} / {with_.utilization - easy.utilization:+.1%} (points)")
        print(f"  {'met   ' if share <= 0.01 else 'MISSED'} GPU-hours lost to preemption <= 1% of all: {share:.2%} "
              f"({with_.lost_gpu_hours:.1f} of {gpu_hours:.0f})")


if __name__ == "__main__":
    main()
