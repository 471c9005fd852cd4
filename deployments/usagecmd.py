"""``e31 usage``: what each tenant, job or day used of a pool, summed from the runs' manifests.

    e31 usage --pool POOL [--since 7d] [--by tenant|job|day] [--json | --csv] [--png FILE]

Reads the Prefect API: the pool's flow runs that ended in the period or have not ended, and the
manifest artifact of each of their attempts (:func:`e31.tasks.deliver.publish_artifacts`); the figures
are sums of those manifests' fields (:mod:`e31.flows.queue.meter`).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any

from e31.errors import EXIT_OK, InvalidInput
from e31.flows.queue.meter import BY, Attempt, RunBill, usage_rows
from e31.states import PLACED

__all__ = ["add_usage", "cmd_usage", "read_bills"]

#: Flow runs and artifacts per API read.
PAGE = 200
#: The columns of the table and the CSV, after the key.
COLUMNS = ("gpu_seconds", "cpu_seconds", "gpu_hours", "cpu_hours", "redone_gpu_hours", "completed", "partial", "failed",
           "running", "queued", "mean_wait_s")


def add_usage(sub: Any) -> None:
    """Add the ``usage`` parser to ``sub`` (argparse subparsers)."""
    from e31.flows.placement.commands import _duration

    u = sub.add_parser("usage", help="what each tenant, job or day used of a pool (from the runs' manifests)",
                       description="GPU-hours and CPU-hours billed (the work's start to the release), GPU-hours "
                                   "redone after preemptions, runs completed, partial, failed and running, and the "
                                   "mean wait, summed from the runs' manifests")
    u.add_argument("--pool", required=True, help="pool file (YAML)")
    u.add_argument("--since", type=_duration, default=7 * 86400.0, metavar="DURATION",
                   help="the period, back from now (default 7d)")
    u.add_argument("--by", choices=BY, default="tenant", help="one row per tenant (default), job or UTC day")
    form = u.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="print one JSON object: pool, since, by, rows, total")
    form.add_argument("--csv", action="store_true", help="print the rows as CSV")
    u.add_argument("--png", help="also write a chart of GPU-hours per tenant per day to this PNG file")


def read_bills(client: Any, pool: Any, since: float, now: float | None = None) -> list[RunBill]:
    """The pool's flow runs that ended after ``since`` (Unix seconds) or have not ended, each with the
    attempts its manifest artifacts record (oldest first).  A deployment's run not yet due (``Scheduled``
    for a time after ``now``, Unix seconds of the server's clock) is not one yet; a run made by a
    deployment's schedule was submitted at its scheduled time (Prefect's ``expected_start_time``), not
    when the server made it (up to days ahead)."""
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey,
                                                FlowRunFilter, FlowRunFilterEndTime, FlowRunFilterState,
                                                FlowRunFilterStateType, WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType

    from e31.flows.queue.mapping import stored_spec, work_pool_name
    from e31.flows.queue.tenancy import tenant_of

    final = [StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED, StateType.CRASHED]
    live = [t for t in StateType if t not in final]
    in_pool = WorkPoolFilter(name=WorkPoolFilterName(any_=[work_pool_name(pool)]))
    after = datetime.fromtimestamp(since, timezone.utc)
    runs = []
    for kinds, ended in ((final, FlowRunFilterEndTime(after_=after)), (live, None)):
        offset = 0
        while True:
            page = client.read_flow_runs(work_pool_filter=in_pool, limit=PAGE, offset=offset,
                                         flow_run_filter=FlowRunFilter(
                                             state=FlowRunFilterState(type=FlowRunFilterStateType(any_=kinds)),
                                             end_time=ended))
            runs += page
            offset += PAGE
            if len(page) < PAGE:
                break
    attempts: dict[str, list[tuple[float, Attempt]]] = {}
    ids = [run.id for run in runs]
    for start in range(0, len(ids), PAGE):
        offset = 0
        while True:
            page = client.read_artifacts(limit=PAGE, offset=offset, artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["manifest"]), flow_run_id=ArtifactFilterFlowRunId(any_=ids[start:start + PAGE])))
            for artifact in page:
                found = _attempt(artifact.data)
                if found is not None and artifact.flow_run_id is not None:
                    found = replace(found, published_at=artifact.created.timestamp())
                    attempts.setdefault(str(artifact.flow_run_id), []).append((artifact.created.timestamp(), found))
            offset += PAGE
            if len(page) < PAGE:
                break
    bills = []
    for run in runs:
        expected = run.expected_start_time.timestamp() if run.expected_start_time is not None else None
        if run.state is not None and run.state.name == "Scheduled" and expected is not None and now is not None \
                and expected > now:
            continue  # a deployment's run not due yet: nobody submitted it so far
        submitted = expected if run.auto_scheduled and expected is not None else run.created.timestamp()
        try:
            gpus = stored_spec(run).request.gpus
        except Exception:  # an unreadable spec: its GPUs from its meter
            gpus = 0
        mine = [a for _, a in sorted(attempts.get(str(run.id), []), key=lambda p: (p[1].released_at or p[0], p[0]))]
        failed = run.state is not None and run.state.type.value in ("FAILED", "CRASHED")
        ended_at = (run.end_time or run.state.timestamp).timestamp() if failed else None
        # waiting for compute: Queued (and Late, AwaitingRetry); a Placed run holds its node
        waiting = run.state is not None and (run.state.type.value == "SCHEDULED" and run.state.name != PLACED
                                             or run.state.type.value == "PAUSED")
        bills.append(RunBill(str(run.id), run.name, tenant_of(run.tags), submitted, gpus,
                             run.state is not None and run.state.is_final(), tuple(mine), ended_at, waiting))
    return bills


def _attempt(data: Any) -> Attempt | None:
    """An attempt from a manifest artifact's table (its first row carries the verdict and the meter)."""
    rows = json.loads(data) if isinstance(data, str) else data
    if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
        return None
    first = rows[0]
    try:
        return Attempt(str(first["status"]), first.get("started_at"), first.get("released_at"),
                       float(first.get("gpu_seconds") or 0.0), float(first.get("cpu_seconds") or 0.0),
                       float(first.get("lost_s") or 0.0))
    except (KeyError, TypeError, ValueError):
        return None


def cmd_usage(args: argparse.Namespace) -> int:
    """``e31 usage --pool POOL``: print the rows (module docstring)."""
    from prefect.client.orchestration import get_client

    from e31.deployments.commands import _need_api, _pool
    from e31.prefect_compat.busy import retry_busy_quickly
    from e31.prefect_compat.clock import measure, server_now

    pool = _pool(args.pool)
    _need_api()
    with retry_busy_quickly(get_client(sync_client=True)) as client:
        measure(client)
        now = server_now()
        since = max(now - args.since, 0.0)  # a period longer than the epoch: everything
        bills = read_bills(client, pool, since, now)
    rows = usage_rows(bills, since, args.by)
    total = usage_rows([b for b in bills], since, "tenant")
    summed = {c: sum((getattr(r, c) or 0) for r in total) for c in COLUMNS if c != "mean_wait_s"}
    summed["gpu_seconds"], summed["cpu_seconds"] = round(summed["gpu_seconds"], 3), round(summed["cpu_seconds"], 3)
    waits = [w for r in total for w in r._waits]
    summed["mean_wait_s"] = round(sum(waits) / len(waits), 3) if waits else None
    if args.png:
        what = _chart(bills, since, args.png)
        print(f"e31 usage: wrote the chart of {what} per tenant per day to {args.png}", file=sys.stderr)
    if args.json:
        print(json.dumps({"pool": pool.name, "since": datetime.fromtimestamp(since, timezone.utc).isoformat(),
                          "by": args.by, "rows": [r.as_dict() for r in rows],
                          "total": {k: (round(v, 6) if isinstance(v, float) else v) for k, v in summed.items()}}))
        return EXIT_OK
    if args.csv:
        out = csv.writer(sys.stdout, lineterminator="\n")
        out.writerow((args.by, *COLUMNS))
        for r in rows:
            d = r.as_dict()
            out.writerow((d["key"], *("" if d[c] is None else d[c] for c in COLUMNS)))
        return EXIT_OK
    from e31.deployments.runwords import print_table

    start = datetime.fromtimestamp(since, timezone.utc)
    from e31.specs.units import format_duration

    print(f"pool {pool.name}: usage since {start:%Y-%m-%d %H:%M} UTC (the last "
          f"{format_duration(timedelta(seconds=round(now - since)))}), by {args.by}")
    if not rows:
        print("  no run of the pool ended or ran in the period")
        return EXIT_OK
    table = [(args.by.upper(), "GPU-H", "CPU-H", "REDONE GPU-H", "DONE", "PARTIAL", "FAILED", "RUNNING", "QUEUED",
              "MEAN WAIT")]
    for r in [*rows, None]:
        d = r.as_dict() if r is not None else {"key": "total", **summed}
        wait = "-" if d["mean_wait_s"] is None else f"{d['mean_wait_s']:.0f} s"
        table.append((str(d["key"]), f"{d['gpu_hours']:.3f}", f"{d['cpu_hours']:.3f}", f"{d['redone_gpu_hours']:.3f}",
                      str(d["completed"]), str(d["partial"]), str(d["failed"]), str(d["running"]), str(d["queued"]),
                      wait))
    print_table(table)
    return EXIT_OK


def _chart(bills: list[RunBill], since: float, path: str) -> str:
    """A stacked bar chart of GPU-hours per tenant per UTC day (CPU-hours when no run was billed a GPU),
    as a PNG at ``path``; returns what it charts (``"GPU-hours"`` or ``"CPU-hours"``).  Raises
    :class:`InvalidInput` when nothing was billed in the period or the file cannot be written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tenants = sorted({b.tenant for b in bills})
    billed = usage_rows(bills, since, "tenant")
    what = "GPU-hours" if any(r.gpu_seconds > 0 for r in billed) or not any(r.cpu_seconds > 0 for r in billed) \
        else "CPU-hours"
    field_ = "gpu_hours" if what == "GPU-hours" else "cpu_hours"
    per = {t: {r.key: getattr(r, field_) for r in usage_rows([b for b in bills if b.tenant == t], since, "day")}
           for t in tenants}
    days = sorted({d for rows in per.values() for d in rows})
    if not days:
        raise InvalidInput("--png: no run of the pool was billed in the period: nothing to chart")
    fig, ax = plt.subplots(figsize=(max(6, len(days) * 0.6), 4))
    bottom = [0.0] * len(days)
    for t in tenants:
        values = [per[t].get(d, 0.0) for d in days]
        ax.bar(days, values, bottom=bottom, label=t)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel(what)
    ax.set_title(f"{what} per tenant per day (UTC)")
    ax.legend()
    fig.autofmt_xdate()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise InvalidInput(f"--png {path}: cannot write the chart there ({exc.strerror or exc}); "
                           "name a file in a folder that exists and you may write") from None
    finally:
        plt.close(fig)
    return what
