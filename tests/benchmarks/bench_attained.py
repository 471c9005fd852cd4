"""Benchmark: jobs that declare no duration, ordered by attained service with preemption, in simulated time.

    python tests/benchmarks/bench_attained.py [--seed 36] [--jobs 3000] [--nodes 16] [--load 0.95]
                                              [--model gpu|lublin|philly] [--processors 256]
                                              [--trace PHILLY_CSV] [--skip 0]
                                              [--checkpoint-every 1800] [--restart-cost 60] [--min-run 600]
                                              [--attained-min-run 3600]
                                              [--attained-loss 300]

The workload is shaped like a shared GPU cluster's (single-node jobs on nodes of 8 GPUs): most jobs
ask for 1 GPU, some for 2, 4 or 8; run times are log-normal with a median of 20 minutes and a heavy
tail (a few jobs run for days), so a small share of the jobs holds most of the GPU-hours, as in the
public traces of such clusters.  Jobs arrive as a Poisson stream sized to offer ``--load`` of the
pool's GPUs.  ``--model lublin`` replays the Lublin-Feitelson model of rigid parallel jobs instead
(:mod:`tests.benchmarks.lublin`: sizes of 1 to ``--processors``, run times of seconds to 45 hours, a
daily cycle of arrivals) on one machine of ``--processors`` processors, each counted as a GPU.
``--model philly --trace FILE`` replays a real GPU cluster's jobs: ``--jobs`` jobs of Microsoft's
Philly trace from the ``--skip``-th by submission time, with their real submission times, GPUs and
run times, on as many nodes of 8 GPUs as make them offer ``--load`` (:mod:`tests.benchmarks.philly`
says where the file comes from; it is not part of this repository).

Side by side in one run:

* FCFS and FCFS+EASY, given every job's exact run time as its estimate (perfect estimates);
* E31 without preemption: the jobs declare no duration (only a limit, ``--limit``), so E31 plans
  them on their limit, as it does today for such jobs;
* E31: the same declarations; the jobs checkpoint every ``--checkpoint-every`` seconds and so are
  preemptible, ordered by attained service (:mod:`e31.flows.placement.attained`), each preempted
  job keeping its work up to its newest checkpoint and paying ``--restart-cost`` at each restart;
  a job is preempted for attained service only within ``--attained-loss`` seconds after a checkpoint.

Printed: mean completion (submission to end), maximum and mean first wait, utilisation (busy
GPU-seconds over those from the first submission to the last end), the last end (hours after the
first submission: utilisation falls when the last long job ends later, the pool idle meanwhile),
preemptions, and the GPU-hours lost to preemption as a share of all; then E31's ratios to
FCFS+EASY against the issue's targets (mean completion <= 0.5x, maximum wait <= FCFS+EASY's,
utilisation within 1 point: at most 1 point lower, a higher one passes; lost <= 1%).  Pure computation: no process, no folder.
"""

from __future__ import annotations

import argparse
import math
import random
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
from e31.flows.placement.preemption import ATTAINED_LOSS_S, ATTAINED_MIN_RUN_S, PreemptionRules  # noqa: E402
from e31.flows.placement.simulate import SimJob, simulate  # noqa: E402

GIB = 1024**3
T0 = 1_767_225_600.0  # 2026-01-01T00:00Z
GPU_MIX = {1: 0.62, 2: 0.12, 4: 0.14, 8: 0.12}
MEDIAN_S, SIGMA = 1200.0, 1.6  # log-normal run time
MAX_RUN_S = 2 * 86400.0


def workload(seed: int, count: int, nodes: int, load: float, limit_s: float) -> list[tuple[QueuedJob, float]]:
    """``count`` jobs as (the declaration with a perfect estimate, the actual run time in seconds)."""
    rng = random.Random(seed)
    sizes, weights = list(GPU_MIX), list(GPU_MIX.values())
    mean_gpus = sum(g * w for g, w in GPU_MIX.items())
    mean_run = MEDIAN_S * math.exp(SIGMA**2 / 2)
    rate = load * nodes * 8 / (mean_gpus * mean_run)  # jobs per second for the offered load
    t, out = T0, []
    for k in range(count):
        t += rng.expovariate(rate)
        gpus = rng.choices(sizes, weights)[0]
        run = min(max(rng.lognormvariate(math.log(MEDIAN_S), SIGMA), 30.0), MAX_RUN_S)
        job = QueuedJob(id=f"j{k:05d}", name=f"job{k}", gpus=gpus, cpus=4 * gpus, memory=32 * GIB * gpus,
                        submitted=round(t), runtime_s=round(run), limit_s=max(limit_s, round(run)),
                        runtime_source="duration")
        out.append((job, round(run)))
    return out


def lublin_workload(seed: int, count: int, processors: int, load: float,
                    limit_s: float) -> list[tuple[QueuedJob, float]]:
    """``count`` jobs of the Lublin-Feitelson model (:mod:`tests.benchmarks.lublin`) on one machine of
    ``processors`` processors, each processor a GPU, as :func:`workload` returns them."""
    out = []
    for k, (at, size, run) in enumerate(lublin.jobs(seed, count, processors, load)):
        job = QueuedJob(id=f"j{k:05d}", name=f"job{k}", gpus=size, cpus=size, memory=GIB * size,
                        submitted=round(T0 + at), runtime_s=round(run), limit_s=max(limit_s, round(run)),
                        runtime_source="duration")
        out.append((job, round(run)))
    return out


def philly_workload(path: Path, count: int, skip: int, load: float,
                    limit_s: float) -> tuple[list[tuple[QueuedJob, float]], int, int]:
    """``count`` jobs of the Philly trace at ``path`` (:mod:`tests.benchmarks.philly`) as
    :func:`workload` returns them, the number of nodes of 8 GPUs on which they offer ``load``, and
    how many jobs of the window were left out (over 8 GPUs)."""
    window, left_out = philly.jobs(path, count, skip)
    out = []
    for k, (at, gpus, run, cluster) in enumerate(window):
        job = QueuedJob(id=f"p{k:05d}", name=f"{cluster}-{k}", gpus=gpus, cpus=4 * gpus, memory=32 * GIB * gpus,
                        submitted=round(at), runtime_s=round(run), limit_s=max(limit_s, round(run)),
                        runtime_source="duration")
        out.append((job, round(run)))
    return out, philly.nodes_for_load(window, load), left_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--model", choices=("gpu", "lublin", "philly"), default="gpu",
                        help="gpu: the GPU-cluster-shaped workload on --nodes nodes of 8 GPUs; lublin: the "
                             "Lublin-Feitelson model on one machine of --processors processors (as GPUs); "
                             "philly: the Philly trace's jobs (--trace) on nodes of 8 GPUs sized for --load")
    parser.add_argument("--trace", type=Path, help="the Philly trace's per-job CSV (--model philly)")
    parser.add_argument("--skip", type=int, default=0, help="--model philly: jobs of the trace to skip first")
    parser.add_argument("--processors", type=int, default=256, help="the Lublin-Feitelson machine's size")
    parser.add_argument("--nodes", type=int, default=16, help="nodes of 8 GPUs")
    parser.add_argument("--load", type=float, default=0.95, help="offered load, a share of the pool's GPUs")
    parser.add_argument("--limit", type=float, default=MAX_RUN_S, help="the limit every job declares, seconds")
    parser.add_argument("--checkpoint-every", type=float, default=1800.0, help="seconds of work between checkpoints")
    parser.add_argument("--restart-cost", type=float, default=60.0, help="seconds a preempted job's restart costs")
    parser.add_argument("--min-run", type=float, default=600.0, help="the pool's preemption min_run, seconds")
    parser.add_argument("--attained-min-run", type=float, default=ATTAINED_MIN_RUN_S,
                        help="the pool's preemption attained_min_run, seconds: the run before a job is preempted for "
                             "attained service")
    parser.add_argument("--attained-loss", type=float, default=ATTAINED_LOSS_S,
                        help="most seconds since its checkpoint a job preempted for attained service loses "
                             "(negative: no bound)")
    parser.add_argument("--max-overhead", type=float, default=None,
                        help="most share of a job's service its preemptions for attained service may cost it, "
                             "e.g. 0.01 (default: the planner's)")
    parser.add_argument("--only", default=None, help="the replays to run, by their names in the table, comma-separated "
                        "(default: all four; the targets are checked when FCFS+EASY's and E31's both ran)")
    args = parser.parse_args()
    if args.model == "philly" and (args.trace is None or not args.trace.is_file()):
        parser.error("--model philly needs --trace FILE, the Philly trace's per-job CSV "
                     "(tests/benchmarks/philly.py says where to get it)")
    with Cleanup("bench_attained"):  # nothing to stop; a signal ends it with 128 + its number
        if args.model == "lublin":
            nodes = [Node("lf", args.processors, args.processors, args.processors * GIB, "H100")]
            jobs = lublin_workload(args.seed, args.jobs, args.processors, args.load, args.limit)
            where = f"the Lublin-Feitelson model on one machine of {args.processors} processors (as GPUs)"
        elif args.model == "philly":
            jobs, count, left_out = philly_workload(args.trace, args.jobs, args.skip, args.load, args.limit)
            nodes = [Node(f"g{i:03d}", 8, 64, 512 * GIB, "H100") for i in range(count)]
            sha = philly.digest(args.trace)
            where = (f"the Philly trace (sha256 {sha[:12]}{'' if sha == philly.SHA256 else ', NOT the documented copy'}) "
                     f"from job {args.skip:,}, {left_out} jobs over 8 GPUs left out, on {count} nodes x 8 GPUs")
            args.jobs = len(jobs)
        else:
            nodes = [Node(f"g{i:03d}", 8, 64, 512 * GIB, "H100") for i in range(args.nodes)]
            jobs = workload(args.seed, args.jobs, args.nodes, args.load, args.limit)
            where = f"{args.nodes} nodes x 8 GPUs"
        perfect = [SimJob(j, run) for j, run in jobs]
        undeclared = [SimJob(replace(j, runtime_s=j.limit_s, runtime_source="limit"), run, preemptible=True)
                      for j, run in jobs]
        rules = PreemptionRules(args.min_run, None, args.attained_loss if args.attained_loss >= 0 else None,
                                restart_s=args.restart_cost, attained_min_run_s=args.attained_min_run)
        if args.max_overhead is not None:
            rules = replace(rules, max_overhead=args.max_overhead if args.max_overhead >= 0 else None)
        gpu_hours = sum(j.gpus * run for j, run in jobs) / 3600
        print(f"{args.jobs:,} jobs, {where}, offered load {args.load:g}, {gpu_hours:,.0f} GPU-hours; "
              f"checkpoints every {args.checkpoint_every:g} s, restart {args.restart_cost:g} s, "
              f"min_run {args.min_run:g} s, attained_min_run {args.attained_min_run:g} s, attained-service preemption "
              f"loses <= {args.attained_loss:g} s")
        print(f"{'replay':<26} {'mean compl':>10} {'max wait':>9} {'mean wait':>9} {'util':>6} {'last end':>8} "
              f"{'preempt':>7} {'lost':>6} {'sim time':>8}")
        first = min(j.submitted for j, _ in jobs)
        runs = {}
        for name, policy, replay, kwargs in (
            ("FCFS (perfect estimates)", "fcfs", perfect, {}),
            ("FCFS+EASY (perfect)", "easy", perfect, {}),
            ("E31, no preemption", "e31", undeclared, {}),
            ("E31", "e31", undeclared, {"preemption": rules, "checkpoint_every_s": args.checkpoint_every,
                                        "restart_cost_s": args.restart_cost}),
        ):
            if args.only is not None and name not in {n.strip() for n in args.only.split(",")}:
                continue
            began = time.perf_counter()
            r = runs[name] = simulate(nodes, replay, policy, **kwargs)
            print(f"{name:<26} {r.mean_completion_s / 3600:>9.2f}h {r.max_wait_s / 3600:>8.1f}h "
                  f"{r.avg_wait_s / 3600:>8.2f}h {r.utilization:>6.1%} {(max(r.ends.values()) - first) / 3600:>7.0f}h "
                  f"{r.preemptions:>7} "
                  f"{r.lost_gpu_hours / gpu_hours:>6.2%} {time.perf_counter() - began:>7.0f}s")
        if "E31" not in runs or "FCFS+EASY (perfect)" not in runs:
            return
        e31, easy = runs["E31"], runs["FCFS+EASY (perfect)"]
        checks = [
            ("mean completion <= 0.5x FCFS+EASY's", e31.mean_completion_s / easy.mean_completion_s, 0.5, "x"),
            ("maximum wait <= FCFS+EASY's", e31.max_wait_s / easy.max_wait_s, 1.0, "x"),
            ("utilisation at most 1 point below FCFS+EASY's", (easy.utilization - e31.utilization) * 100, 1.0, " pt"),
            ("GPU-hours lost to preemption <= 1%", e31.lost_gpu_hours / gpu_hours * 100, 1.0, "%"),
        ]
        for what, value, bound, unit in checks:
            print(f"  {'met   ' if value <= bound else 'MISSED'} {what}: {value:.3f}{unit}")


if __name__ == "__main__":
    main()
