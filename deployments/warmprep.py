"""What the warm flow process (:mod:`e31.deployments.warmstart`) prepares
once, before its first fork, so that no flow process it forks does it again:
Prefect's API objects every run of the pool's queue deployment reads at its
start (:func:`prefill`), and the pydantic models Prefect builds at their
first use (:func:`build_models`)."""

from __future__ import annotations

from typing import Any


def prefill(work_pool: str) -> int:
    """Read, before any fork, what each flow run of ``work_pool``'s queue
    deployment (``e31-job/queue-<pool>``) would read from the API at its
    start, into the process-wide caches its forks inherit: the work pool,
    the deployment, its flow and its work queue, which Prefect's events name
    as a run's related resources (``prefect.events.related.RESOURCE_CACHE``,
    keyed as ``related_resources_from_run_context`` looks them up: 4 GETs
    per flow process before).  Runs of other deployments read theirs as
    before.  Best effort: an API
    that does not answer, or a pool without its deployment yet, leaves the
    rest to the runs.  Returns how many objects it cached.  The client is
    closed before any fork (a forked copy of an open connection is not
    used)."""
    from prefect.client.orchestration import get_client
    from prefect.events.related import RESOURCE_CACHE
    from prefect.types._datetime import now

    from e31.flows.deploy import FLOW_NAME
    from e31.flows.queue.mapping import deployment_name

    cached = 0

    def keep(kind: str, key: Any, obj: Any) -> None:
        nonlocal cached
        RESOURCE_CACHE[f"{kind}.{key}"] = ({"kind": kind, "object": obj}, now("UTC"))
        cached += 1

    try:
        with get_client(sync_client=True) as client:
            keep("work-pool", work_pool, client.read_work_pool(work_pool))
            deployment = client.read_deployment_by_name(f"{FLOW_NAME}/{deployment_name(work_pool)}")
            keep("deployment", deployment.id, deployment)
            keep("flow", deployment.flow_id, client.read_flow(deployment.flow_id))
            if deployment.work_queue_id:
                keep("work-queue", deployment.work_queue_id, client.read_work_queue(deployment.work_queue_id))
    except Exception:  # noqa: BLE001 - the runs read what is missing themselves
        pass
    return cached


def build_models() -> int:
    """Complete, before any fork, the pydantic models that are built at
    their first use (Prefect defines many with forward references: their
    validators and serializers are built by the first instance), so each
    flow process does not build the same ones again (~7 % of a short run's
    Python CPU: its artifacts, flow-run updates, events).  Returns how many
    it built; a model that cannot be built yet is left to its first use."""
    from pydantic import BaseModel

    built, todo, seen = 0, [BaseModel], set()
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub in seen:
                continue
            seen.add(sub)
            todo.append(sub)
            if not getattr(sub, "__pydantic_complete__", True) and not getattr(sub, "__pydantic_generic_metadata__",
                                                                                {}).get("parameters"):
                try:
                    built += bool(sub.model_rebuild(raise_errors=False))
                except Exception:  # noqa: BLE001 - left to its first use
                    pass
    return built
