"""The planner's commands: ``e31 pool``, ``e31 plan``, ``e31 simulate`` (registered by :mod:`e31.flows.cli`).

    e31 pool [POOL.yaml]                    the pool's nodes (no file: this machine as a one-node pool)
    e31 plan SPEC... --pool POOL.yaml [--png plan.png] [--policy P] [--now TIME]
    e31 simulate TRACE.swf --pool POOL.yaml [--policy P] [--jobs N] [--json] [--as cpus|gpus]
                 [--deadlines FACTOR [--deadline-every K]]

``e31 plan`` exits 0 when every job is placed, 1 when any is refused, 2 for
bad input (a spec, the pool, a flag); it plans with each spec's duration (else
its limit) and no staging time.  ``e31 simulate`` exits 0, or 2 for bad input;
``--json`` adds ``refused`` and ``deadlines_feasible`` to the metrics the issue
names.  No Prefect import.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, Callable

from e31.errors import EXIT_FAILED, EXIT_OK, InvalidInput

from .model import Node, QueuedJob
from .planner import POLICIES, plan
from .tenants import tenancy_of
from .text import clock, gib, where

__all__ = ["add_commands", "nodes_of"]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def _duration(text: str) -> float:
    from e31.specs.units import parse_duration

    try:
        seconds = parse_duration(text).total_seconds()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; use e.g. 30m, 1h or 90s") from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be longer than 0 seconds (got {text!r})")
    return seconds


def _interval(text: str) -> float:
    """A checkpoint interval: a duration of at least one second (each checkpoint is a planning event)."""
    seconds = _duration(text)
    if seconds < 1.0:
        raise argparse.ArgumentTypeError(f"must be at least 1 second (got {text!r}); use e.g. 30m")
    return seconds


def _factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number such as 1.5 (got {text!r})") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: a job cannot finish before its limit allows "
                                         f"(got {text})")
    return value


_EARLIEST = datetime(1971, 1, 1, tzinfo=timezone.utc)
_LATEST = datetime(9000, 1, 1, tzinfo=timezone.utc)


def _instant(text: str) -> float:
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an ISO 8601 time such as 2026-01-01T06:00:00Z (got {text!r})") from None
    if at.tzinfo is None:
        raise argparse.ArgumentTypeError(f"needs a timezone, e.g. {text}Z or {text}+00:00")
    if not _EARLIEST <= at <= _LATEST:  # plans reach past it by their jobs' run times: keep within datetime's years
        raise argparse.ArgumentTypeError(f"must be between {_EARLIEST.date()} and {_LATEST.date()} (got {text!r})")
    return at.timestamp()


def add_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Add the ``pool``, ``plan`` and ``simulate`` parsers to ``sub`` (argparse subparsers); returns
    command name -> handler(args) -> exit code."""
    p = sub.add_parser("pool", help="print a pool's nodes (no file: this machine)",
                       description="print the nodes of a pool file; with no file, this machine as a one-node pool")
    p.add_argument("pool", nargs="?", help="pool file (YAML or JSON)")
    q = sub.add_parser("plan", help="plan job specs onto an empty pool, as if submitted now",
                       description="the plan of the given job specs, submitted now onto an empty pool: node, GPU "
                                   "devices, start, end and the reason of each; exit 1 if any is refused")
    q.add_argument("specs", nargs="+", metavar="SPEC", help="job spec files")
    q.add_argument("--pool", required=True, help="pool file (YAML or JSON)")
    q.add_argument("--png", help="also write a Gantt chart of the plan to this PNG file")
    q.add_argument("--policy", default="e31", choices=POLICIES, help="planning policy (default e31)")
    q.add_argument("--now", type=_instant, help="plan as of this time (ISO 8601 with a timezone; default: now)")
    q.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field of every SPEC by dotted path, e.g. --set request.nodes=2")
    q.add_argument("--tenant", help="plan the jobs as this tenant's (default: the tenant whose members include you, "
                                    "else default); the pool's quotas and borrow limits apply, with no past usage")
    s = sub.add_parser("simulate", help="replay a workload trace (SWF) through the planner",
                       description="replay a Standard Workload Format trace on a pool in simulated time and print "
                                   "the policy's metrics")
    s.add_argument("trace", help="SWF trace file (Parallel Workloads Archive format)")
    s.add_argument("--pool", required=True, help="pool file (YAML or JSON)")
    s.add_argument("--policy", default="e31", choices=POLICIES, help="planning policy (default e31)")
    s.add_argument("--jobs", type=_positive, metavar="N", help="replay only the first N jobs of the trace")
    s.add_argument("--json", action="store_true",
                   help="print the metrics as one JSON object: jobs, refused, makespan_s, avg_wait_s, max_wait_s, "
                        "avg_bounded_slowdown, utilization, deadlines_met, deadlines_total, deadlines_feasible, "
                        "mean_completion_s, preemptions, lost_gpu_hours, planning_s, resource (gpus or cpus: what every "
                        "*_hours counts, CPU-hours for a CPU trace); with tenants also tenants: {name: "
                        "{jobs, mean_wait_s, gpu_hours}}")
    s.add_argument("--as", dest="unit", default="cpus", choices=("cpus", "gpus"),
                   help="what a trace job's processors are on the pool (default cpus); with gpus, a job of more "
                        "processors than the pool's largest node has GPUs runs on several nodes at once, an equal "
                        "share on each (32 on nodes of 8 GPUs: 4 nodes of 8; 12: 2 nodes of 6)")
    s.add_argument("--deadlines", type=_factor, metavar="FACTOR",
                   help="give jobs a deadline of submit time + FACTOR x their limit")
    s.add_argument("--deadline-every", type=_positive, default=None, metavar="K",
                   help="with --deadlines, only every K-th job of the trace gets one, from the first: jobs 1, "
                        "K+1, 2K+1, ... in trace order (default 1: all)")
    s.add_argument("--checkpoint-every", type=_interval, metavar="DURATION",
                   help="jobs checkpoint after each DURATION of work (e.g. 30m); jobs without a deadline are then "
                        "preemptible (request.preemptible's default) and a preempted job keeps its work up to its "
                        "last checkpoint; preemptible jobs that declared no duration (requested time -1) are "
                        "ordered by attained service; the pool's preemption: options apply")
    s.add_argument("--restart-cost", type=_duration, default=0.0, metavar="DURATION",
                   help="with --checkpoint-every, the time a preempted job spends at each later start before its "
                        "work goes on (default 0)")
    s.add_argument("--default-limit", type=_duration, metavar="DURATION",
                   help="a trace job whose requested time is -1 declared no duration: it runs until done, with this "
                        "limit (default: its actual run time, a perfect estimate)")
    s.add_argument("--fair-share", action="store_true",
                   help="with a pool that declares no tenants: each SWF user id is a tenant (u<id>) of equal "
                        "weight and no quota, ordered by fair share (a pool with tenants: its tenants apply, "
                        "the trace's user ids mapped by their members, e.g. members: [u3, u7])")
    return {"pool": cmd_pool, "plan": cmd_plan, "simulate": cmd_simulate}


def nodes_of(pool: Any) -> list[Node]:
    """The planner's nodes of a :class:`e31.specs.PoolSpec` (``count`` expanded)."""
    return [Node(name, line.gpus, line.cpus, line.memory, line.gpu_type, line.group)
            for name, line in pool.node_lines()]


def cmd_pool(args: argparse.Namespace) -> int:
    """``e31 pool [POOL]``: a table of the pool's node lines and the totals."""
    if args.pool:
        from e31.specs import load_pool

        pool = load_pool(args.pool)
        title, lines = f"pool {pool.name}", [(line.names(), line) for line in pool.nodes]
        nodes = nodes_of(pool)
    else:
        from e31.flows.admission import this_node

        here = this_node()
        nodes = [Node(here.name, here.gpus, here.cpus, here.memory)]
        title, lines = f"this machine ({here.name}) as a one-node pool", [([here.name], nodes[0])]
    print(f"{title}: {len(nodes)} node{'s' if len(nodes) != 1 else ''}, {sum(n.gpus for n in nodes)} GPUs, "
          f"{sum(n.cpus for n in nodes)} CPUs, {gib(sum(n.memory for n in nodes))} memory")
    rows = [("NODES", "COUNT", "GPUS", "GPU TYPE", "CPUS", "MEMORY")]
    for names, line in lines:
        span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        rows.append((span, str(len(names)), str(line.gpus), line.gpu_type or "-", str(line.cpus), gib(line.memory)))
    _table(rows, right={1, 2, 4, 5})
    if args.pool:
        from e31.specs.units import format_duration

        rules = pool.preemption
        cap = "no cap" if rules.max_per_day is None else (
            "never preempts" if rules.max_per_day == 0 else f"at most {rules.max_per_day} per job in 24 hours")
        print(f"preemption: min_run {format_duration(rules.min_run)}, attained_min_run "
              f"{format_duration(rules.attained_min_run)}; {cap}")
        if pool.tenants:
            _tenants_table(pool)
    return EXIT_OK


def _tenants_table(pool: Any) -> None:
    """The pool's tenants: quota, weight, borrow limit and members, and the fair share's half-life."""
    from e31.specs.units import format_duration, format_memory

    def amount(res: Any, missing: str) -> str:
        if res is None:
            return missing
        parts = [f"{res.gpus} GPU{'' if res.gpus == 1 else 's'}" if res.gpus is not None else "",
                 f"{res.cpus} CPU{'' if res.cpus == 1 else 's'}" if res.cpus is not None else "",
                 format_memory(res.memory) if res.memory is not None else ""]
        return ", ".join(p for p in parts if p) or missing

    print(f"tenants (fair share half-life {format_duration(pool.fair_share.half_life)}; a job of anyone else is "
          f"tenant default's):")
    rows = [("TENANT", "QUOTA", "WEIGHT", "BORROW LIMIT", "MEMBERS")]
    for t in pool.tenants:
        rows.append((t.name, amount(t.quota, "none"), f"{t.weight:g}", amount(t.borrow_limit, "any"),
                     ", ".join(t.members) or "-"))
    _table(rows)


def _table(rows: list[tuple[str, ...]], right: set[int] = frozenset()) -> None:
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    for r in rows:
        cells = [c.rjust(w) if k in right else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths))]
        print("  ".join(cells).rstrip())


def _queued(specs: list[Any], now: float) -> list[QueuedJob]:
    from e31.flows.compile import resolve_deadline, return_reserve_s

    from .estimates import estimate_runtime

    jobs, seen = [], {}
    for spec in specs:
        seen[spec.name] = seen.get(spec.name, 0) + 1
        job_id = spec.name if seen[spec.name] == 1 else f"{spec.name}#{seen[spec.name]}"
        req = spec.request
        limit = (req.limit or req.duration).total_seconds()
        estimate = estimate_runtime(req.duration.total_seconds() if req.duration else None, limit)
        deadline, _ = resolve_deadline(spec, datetime.fromtimestamp(now, timezone.utc))
        jobs.append(QueuedJob(id=job_id, name=spec.name, nodes=req.nodes, gpus=req.gpus, cpus=req.cpus,
                              memory=req.memory or 0, submitted=now, runtime_s=estimate.runtime_s, limit_s=limit, gpu_type=req.gpu_type,
                              deadline=deadline.timestamp() if deadline else None,
                              runtime_source=estimate.source, runtime_note=estimate.note,
                              return_s=return_reserve_s() if deadline else 0.0))
    return jobs


def cmd_plan(args: argparse.Namespace) -> int:
    """``e31 plan SPEC... --pool POOL``: the table of the plan; exit 1 when a job is refused."""
    from e31.specs import load_pool, load_spec

    from e31.specs.deadlines import deadlines_as_of

    pool = load_pool(args.pool)
    now = args.now if args.now is not None else datetime.now(timezone.utc).timestamp()
    with deadlines_as_of(datetime.fromtimestamp(now, timezone.utc) if args.now is not None else None):
        specs = [load_spec(path, overrides=args.overrides) for path in args.specs]
    import getpass

    if args.tenant is not None and pool.tenant(args.tenant) is None:
        raise InvalidInput(f"--tenant: pool {pool.name} has no tenant {args.tenant!r}; name one of "
                           f"{', '.join(pool.tenant_names())}, or add it to the pool file's tenants")
    tenant = args.tenant or pool.tenant_of(getpass.getuser())
    nodes, jobs = nodes_of(pool), [replace(j, tenant=tenant) for j in _queued(specs, now)]
    placements = plan(nodes, [], jobs, now, args.policy, tenancy=tenancy_of(pool) if pool.tenants else None)
    print(f"plan of {len(jobs)} job{'s' if len(jobs) != 1 else ''} on pool {pool.name} at {clock(now, now)} "
          f"(policy {args.policy}{f'; tenant {tenant}' if pool.tenants else ''})")
    rows = [("JOB", "ACTION", "NODE", "GPUS", "START", "END", "REASON")]
    for p in sorted(placements, key=lambda p: (p.action == "refuse", p.start or 0.0, p.job)):
        when = [clock(t, now) if t is not None else "-" for t in (p.start, p.end)]
        node, devices = where(p.node, p.devices, p.gang)  # a multi-node job: every node, its first first
        rows.append((p.job, p.action, node, devices, *when, p.reason))
    _table(rows)
    if args.png:
        from .gantt import gantt_png

        try:
            gantt_png(args.png, nodes, placements, jobs, now)
        except OSError as exc:
            raise InvalidInput(f"--png: cannot write {args.png}: {exc.strerror or exc}; give a writable path") from None
        print(f"Gantt chart: {args.png}")
    return EXIT_FAILED if any(p.action == "refuse" for p in placements) else EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    """``e31 simulate TRACE --pool POOL``: the metrics of one replay."""
    from e31.specs import load_pool

    from .simulate import SimJob, simulate
    from .swf import read_swf

    pool = load_pool(args.pool)
    nodes = nodes_of(pool)
    if args.unit == "gpus" and not any(n.gpus for n in nodes):
        raise InvalidInput(f"--as gpus: pool {pool.name} has no GPUs; use --as cpus or a pool with gpus")
    if args.deadline_every is not None and args.deadlines is None:
        raise InvalidInput("--deadline-every gives deadlines to every K-th job only with --deadlines FACTOR; add "
                           "--deadlines (e.g. --deadlines 2), or drop --deadline-every")
    if args.restart_cost and args.checkpoint_every is None:
        raise InvalidInput("--restart-cost is the cost of a preempted job's restart, and jobs are preempted only "
                           "with --checkpoint-every; add --checkpoint-every (e.g. 30m), or drop --restart-cost")
    every = args.deadline_every or 1
    trace = read_swf(args.trace, args.jobs)
    jobs = []
    widest = max(n.gpus for n in nodes)
    for k, t in enumerate(trace.jobs):
        gpus, cpus = (t.procs, 1) if args.unit == "gpus" else (0, t.procs)
        spread = 1
        if args.unit == "gpus" and gpus > widest:  # a gang: as few nodes as hold it, an equal share on each
            spread = -(-gpus // widest)
            gpus = -(-gpus // spread)
        submitted = trace.start + t.submit
        limit = t.limit_s if t.declared or args.default_limit is None else args.default_limit
        deadline = None
        if args.deadlines is not None and k % every == 0:
            deadline = submitted + args.deadlines * limit
        job = QueuedJob(id=t.id, name=t.id, gpus=gpus, cpus=cpus, memory=0, submitted=submitted,
                        runtime_s=limit, limit_s=limit, deadline=deadline, runtime_source="limit", nodes=spread)
        # request.preemptible's default: checkpoints declared and no deadline
        jobs.append(SimJob(job, t.runtime_s, preemptible=args.checkpoint_every is not None and deadline is None))
    if len({j.job.id for j in jobs}) != len(jobs):
        raise InvalidInput(f"{args.trace}: two jobs have the same job number; SWF job numbers are unique")
    tenancy = None
    if pool.tenants or args.fair_share:
        from dataclasses import replace

        from .tenants import Tenant, tenancy_of

        tenancy = tenancy_of(pool)
        users = [f"u{t.user}" if t.user else "default" for t in trace.jobs]
        if not pool.tenants:
            tenancy = replace(tenancy, tenants={u: Tenant(u) for u in sorted(set(users))})
            names = users
        else:
            names = [pool.tenant_of(u) for u in users]
        jobs = [replace(j, job=replace(j.job, tenant=name)) for j, name in zip(jobs, names)]
    rules = None
    if args.checkpoint_every is not None:
        from .preemption import PreemptionRules

        rules = PreemptionRules(pool.preemption.min_run.total_seconds(), pool.preemption.max_per_day,
                               attained_min_run_s=pool.preemption.attained_min_run.total_seconds())
    result = simulate(nodes, jobs, args.policy, preemption=rules, checkpoint_every_s=args.checkpoint_every,
                      restart_cost_s=args.restart_cost, tenancy=tenancy)
    from .simulate import resource_of

    resource = resource_of([j.job for j in jobs])
    if args.json:  # every *_hours figure counts the resource the jobs use: GPU-hours, or CPU-hours for a CPU trace
        print(json.dumps({**result.summary(), "resource": resource}))
        return EXIT_OK
    unit = "GPUs" if resource == "gpus" else "CPUs"
    gangs = sum(1 for j in jobs if j.job.nodes > 1)
    spread = f", {gangs} of them on several nodes" if gangs else ""
    print(f"trace {args.trace}: {len(jobs)} jobs{spread} ({trace.skipped} skipped: unknown run time or processors); "
          f"pool {pool.name} ({len(nodes)} node{'s' if len(nodes) != 1 else ''}); policy {args.policy}")
    deadlines = (f"{result.deadlines_met} of {result.deadlines_total} ({result.deadlines_feasible} feasible on an "
                 f"empty pool)" if result.deadlines_total else "none assigned (--deadlines FACTOR)")
    for name, value in (
        ("jobs run", f"{result.jobs}"), ("refused", f"{result.refused}"), ("makespan", f"{result.makespan_s:.0f} s"),
        ("average wait", f"{result.avg_wait_s:.1f} s"), ("maximum wait", f"{result.max_wait_s:.0f} s"),
        ("average bounded slowdown", f"{result.avg_bounded_slowdown:.3f} (threshold 10 s)"),
        (f"utilisation ({unit})", f"{result.utilization:.1%}"), ("deadlines met", deadlines),
        ("mean completion", f"{result.mean_completion_s:.1f} s"),
        ("preemptions", f"{result.preemptions} ({result.lost_gpu_hours:.2f} {unit[:-1]}-hours lost)"),
        ("planning time", f"{result.planning_s:.3f} s"),
    ):
        print(f"  {name:<26}{value}")
    if result.tenants:
        total = sum(row["gpu_hours"] for row in result.tenants.values()) or 1.0
        print(f"  {'tenant':<16}{'jobs':>8}{'mean wait':>14}{unit[:-1] + '-hours':>14}{'share':>8}")
        for name, row in result.tenants.items():
            print(f"  {name:<16}{row['jobs']:>8}{row['mean_wait_s']:>12.1f} s{row['gpu_hours']:>14.2f}"
                  f"{row['gpu_hours'] / total:>8.1%}")
    sys.stdout.flush()
    return EXIT_OK
