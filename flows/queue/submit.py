"""Create a pool's work pool and queue deployment, and submit a job as a
queued flow run of it."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from e31.prefect_compat.clock import measure, offset_s, server_now
from e31.flows.queue.mapping import AHEAD_S, WORKER_TYPE, deployment_name, work_pool_name
from e31.specs.pool import PoolSpec


def ensure_pool(client: Any, pool: PoolSpec, job_template: dict[str, Any] | None = None) -> str:
    """Create the pool's work pool (type ``e31``, with ``job_template`` as
    its base job template: the E31 worker's) and its queue deployment when
    missing; returns the deployment's id."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    from e31.flows.deploy import ENTRYPOINT, FLOW_NAME

    name = work_pool_name(pool)
    try:
        client.read_work_pool(name)
    except ObjectNotFound:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type=WORKER_TYPE, base_job_template=job_template or {}))
        except ObjectAlreadyExists:
            pass
    try:
        return str(client.read_deployment_by_name(f"{FLOW_NAME}/{deployment_name(pool)}").id)
    except ObjectNotFound:
        pass
    from prefect.deployments.runner import RunnerDeployment

    from e31.flows.job import run_job

    deployment = RunnerDeployment.from_flow(run_job, name=deployment_name(pool), work_pool_name=name,
                                            description=f"E31 queue of pool {pool.name}: e31 submit creates runs")
    deployment.entrypoint = ENTRYPOINT
    return str(deployment.apply(work_pool_name=name))


_DEPLOYMENTS: dict[tuple[str, str], str] = {}  # (API URL, pool) -> its queue deployment's id, once ensured


def submit(client: Any, pool: PoolSpec, parameters: dict[str, Any], tags: list[str],
           job_template: dict[str, Any] | None = None) -> Any:
    """Create the queued flow run of a job (``parameters``: the flow's
    ``spec`` and ``code_dir``); returns the flow run.  The request carries
    a fresh idempotency key: sent again after a 503 (a busy database, by
    Prefect's client or :mod:`e31.prefect_compat.busy`), it cannot create
    a second run."""
    import uuid

    from e31.states import queued

    key = (str(client.api_url), pool.name)
    if key not in _DEPLOYMENTS:
        _DEPLOYMENTS[key] = ensure_pool(client, pool, job_template)
    deployment_id = _DEPLOYMENTS[key]
    if offset_s() is None:  # its scheduled time is on the server's clock: the cache's filters read it so
        measure(client)
    return client.create_flow_run_from_deployment(
        deployment_id, parameters=parameters, tags=tags, name=str(parameters["spec"].get("name")),
        idempotency_key=f"e31-submit-{uuid.uuid4()}",
        state=queued("Queued: waiting for the scheduler to place it",
                     datetime.fromtimestamp(server_now() + AHEAD_S, timezone.utc)))

