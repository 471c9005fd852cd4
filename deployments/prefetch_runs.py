"""The flow runs a node's prefetcher reads and marks on the Prefect server:
the queued runs planned on its node, the jobs placed there, and the tags
that tell the scheduler which node holds a run's inputs staged."""

from __future__ import annotations

from typing import Any

#: Soonest queued runs of the pool read per pass (the ones planned on this node are taken from them).
LOOKAHEAD = 50


def planned_here(client: Any, pool: Any, node: str, limit: int = LOOKAHEAD) -> list[Any]:
    """The pool's queued flow runs planned on ``node``, soonest planned start
    first (of the ``limit`` soonest queued runs of the pool)."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateName,
                                                FlowRunFilterStateType, WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    from e31.flows.queue import QUEUED, planned_node, work_pool_name

    runs = client.read_flow_runs(
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[work_pool_name(pool)])),
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
            type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]), name=FlowRunFilterStateName(any_=[QUEUED]))),
        sort=FlowRunSort.NEXT_SCHEDULED_START_TIME_ASC, limit=limit)  # the planned start (its scheduled time)
    return [r for r in runs if planned_node(r) == node]  # its placement's planned node (e31_planned)


def tag_staged(client: Any, run_id: str, node: str, seconds: float) -> None:
    """Tell the scheduler that ``node`` holds the run's inputs staged, and
    how long staging them took (``seconds``; 0: not measured): tags
    ``e31-staged``, ``e31-staged:NODE``, ``e31-staging-s:N`` on the flow run
    (a PATCH of its tags alone: the scheduler's writes are untouched).  The
    planner then prefers this node (see
    :attr:`e31.flows.placement.QueuedJob.locality_wait_s`).  Best effort."""
    from e31.flows.queue import STAGED, STAGED_ON, STAGING_S, staged_tags

    from e31.prefect_compat.tags import change_tags

    def staged(tags: list[str]) -> list[str]:
        _, before = staged_tags(tags)
        keep = [t for t in tags if t != STAGED and t != STAGED_ON + node and not t.startswith(STAGING_S)]
        keep += [STAGED, STAGED_ON + node]
        if max(before, seconds) > 0:
            keep.append(f"{STAGING_S}{max(before, seconds):.0f}")
        return keep

    try:
        change_tags(client, run_id, staged)
    except Exception:
        pass


def untag_staged(client: Any, run_id: str, node: str) -> None:
    """Take back :func:`tag_staged` of ``node`` (its copy was evicted).  Best effort."""
    from e31.flows.queue import STAGED, STAGED_ON

    from e31.prefect_compat.tags import change_tags

    def unstaged(tags: list[str]) -> list[str]:
        tags = [t for t in tags if t != STAGED_ON + node]
        return tags if any(t.startswith(STAGED_ON) for t in tags) else [t for t in tags if t != STAGED]

    try:
        change_tags(client, run_id, unstaged)
    except Exception:
        pass


def starting_here(client: Any, pool: Any, node: str) -> set[str]:
    """The names of the jobs placed on ``node`` whose runs have not ended
    (``Placed``, ``Pending``, ``Running``): their staged copies are about
    to be used, or are in use."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType

    from e31.flows.queue import NODE_VAR, PLACED, placement_of, work_pool_name

    runs = client.read_flow_runs(
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[work_pool_name(pool)])),
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
            any_=[StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]))))
    return {str(((r.parameters or {}).get("spec") or {}).get("name")) for r in runs
            if placement_of(r).get(NODE_VAR) == node
            and (r.state.type != StateType.SCHEDULED or r.state.name == PLACED)}
