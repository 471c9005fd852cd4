"""Each tenant's past usage of a pool, decayed with the pool's half-life: what fair share weighs.

Read from the Prefect API: the pool's flow runs that ended within the last :data:`HORIZON_HALF_LIVES`
half-lives, each counting its request (GPUs, CPUs, memory) for its run time (Prefect's ``total_run_time``,
the sum of its attempts' ``Running`` spells: the waits of a preempted run between attempts are not
usage), taken to end at its end
(:func:`e31.flows.placement.tenants.decayed_service`); a run still going counts from its start to now
(:func:`with_running`).  Older usage weighs under 1/32 of new and is left out.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from e31.flows.placement.model import RunningJob
from e31.flows.placement.tenants import Amount, Tenancy, decayed_service, sum_of, tenancy_of
from e31.flows.queue.mapping import stored_spec, work_pool_name
from e31.flows.queue.tenancy import tenant_of
from e31.specs.pool import PoolSpec

__all__ = ["HORIZON_HALF_LIVES", "PAGE", "Usage", "read_usage", "with_running"]

#: How many half-lives back ended runs are read.
HORIZON_HALF_LIVES = 5
#: Flow runs per API read.
PAGE = 200
#: The most ended runs one read takes (the newest first): a bound on the scheduler's work.
MAX_RUNS = 20_000

Usage = tuple[dict[str, Amount], float]  # tenant -> decayed usage (GPU-, CPU-, byte-seconds), as of Unix seconds


def read_usage(client: Any, pool: PoolSpec, now: float) -> Usage:
    """Each tenant's decayed usage of ``pool`` by its ended flow runs, as of ``now`` (Unix seconds, the
    server's clock).  Runs whose spec cannot be read count nothing."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterEndTime, FlowRunFilterState,
                                                FlowRunFilterStateType, WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    half = pool.fair_share.half_life.total_seconds()
    since = datetime.fromtimestamp(now, timezone.utc) - timedelta(seconds=HORIZON_HALF_LIVES * half)
    final = [StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED, StateType.CRASHED]
    usage: dict[str, Amount] = {}
    for offset in range(0, MAX_RUNS, PAGE):
        runs = client.read_flow_runs(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[work_pool_name(pool)])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=final)),
                                          end_time=FlowRunFilterEndTime(after_=since)),
            sort=FlowRunSort.END_TIME_DESC, limit=PAGE, offset=offset)
        for run in runs:
            if run.start_time is None or run.end_time is None:
                continue
            try:
                req = stored_spec(run).request
            except Exception:  # an unreadable spec: planned as invalid elsewhere, counts nothing here
                continue
            # a run preempted or crashed and queued again ran in several attempts: its first start to its end
            # would bill its waits between them too; its run time (Prefect's total over its Running
            # states) is what it held, counted as ending at its end
            # ``now`` is an estimate of the server's clock that a busy server's stale ``Date`` headers can put a
            # second or two early: an end past it is taken as now, so the run's whole run time still counts
            end = min(run.end_time.timestamp(), now)
            start = min(run.start_time.timestamp(), end)
            ran = run.total_run_time.total_seconds() if run.total_run_time is not None else end - start
            used = decayed_service((float(req.gpus), float(req.cpus), float(req.memory or 0)),
                                   end - min(ran, run.end_time.timestamp() - run.start_time.timestamp()), end, now, half)
            tenant = tenant_of(run.tags)
            usage[tenant] = sum_of((usage.get(tenant, (0.0, 0.0, 0.0)), used))
        if len(runs) < PAGE:
            break
    return usage, now


def with_running(pool: PoolSpec, usage: Usage, running: list[RunningJob], now: float) -> Tenancy:
    """The pool's :class:`Tenancy` at ``now``: ``usage`` decayed from when it was read to ``now``, plus the
    service its ``running`` jobs have had so far (from their start)."""
    half = pool.fair_share.half_life.total_seconds()
    past, at = usage
    decay = 2 ** (-max(now - at, 0.0) / half)
    totals = {name: tuple(v * decay for v in amount) for name, amount in past.items()}
    for r in running:
        add = decayed_service((float(len(r.devices)), float(r.cpus), float(r.memory)), r.start, now, now, half)
        totals[r.tenant] = sum_of((totals.get(r.tenant, (0.0, 0.0, 0.0)), add))
    return tenancy_of(pool, totals)  # type: ignore[arg-type]
