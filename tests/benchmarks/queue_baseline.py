"""The baseline of ``bench_queue.py``: the same short jobs as a hand-written
plain Prefect flow, on a ``process`` work pool served by Prefect's own
``prefect worker start --type process --limit 1`` (one per node), against
the same Prefect server.

What a user without E31 would run: a flow of three tasks (``stage``: copy
the job's input into a scratch folder with fsspec; ``run``: the work as a
subprocess; ``put``: copy its result to the output folder with fsspec).
No placement, no reasons, no manifest, no checkpoint task, no supervision:
any worker takes any run as soon as it has room, polling every
``PREFECT_WORKER_QUERY_SECONDS`` (1 s here, as ``e31 worker``'s own poll).
It measures what Prefect's own run lifecycle costs on this machine, the
floor under any queue built on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import fsspec
from prefect import flow, task


@task
def stage(src: str, scratch: str) -> str:
    """Copy the input ``src`` into ``scratch``; returns the local path."""
    local = Path(scratch) / Path(src).name
    local.parent.mkdir(parents=True, exist_ok=True)
    fsspec.filesystem("file").get(src, str(local))
    return str(local)


@task
def run(work: str, seconds: float, out: str) -> str:
    """Run the work (``python -c WORK SECONDS``) with ``E31_OUTPUT_DIR=out``; returns ``out``."""
    Path(out).mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", work, str(seconds)], check=True, env={**os.environ, "E31_OUTPUT_DIR": out})
    return out


@task
def put(out: str, dest: str) -> None:
    """Copy the work's ``r.json`` to the folder ``dest``."""
    Path(dest).mkdir(parents=True, exist_ok=True)
    fsspec.filesystem("file").put(str(Path(out) / "r.json"), str(Path(dest) / "r.json"))


@flow(name="plain-job", persist_result=False)
def plain_job(src: str, scratch: str, dest: str, work: str, seconds: float) -> None:
    """stage -> run -> put, each a Prefect task."""
    stage(src, scratch)
    put(run(work, seconds, str(Path(scratch) / "out")), dest)


def _stop_on_failure(deployment_id: Any) -> None:
    """Exit with the first failed run's state message (a broken baseline must not wait 3 h)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
    bad = [r for r in runs if r.state is not None and r.state.is_final() and not r.state.is_completed()]
    if bad:
        raise SystemExit(f"baseline: run {bad[0].name} ended {bad[0].state.name}: {bad[0].state.message}")


def run_baseline(jobs: int, nodes: int, work_s: float, work: str, inputs: list[Path], root: Path,
                 env: dict[str, str], server_pid: int, tree_cpu: Any, machine_cpu: Any) -> dict[str, float]:
    """Submit ``jobs`` runs of :func:`plain_job` (all at once), start
    ``nodes`` Prefect process workers, wait for every ``r.json``; returns
    ``wall_s`` (workers' start to the last work's end), ``busy_s`` (the
    machine's CPU-seconds meanwhile, ``machine_cpu()``; ``steal_s`` of them
    taken by a virtual machine's host), ``server_s`` and
    ``workers_s`` (CPU-seconds of the server and of the workers with their
    flow processes meanwhile, ``tree_cpu(pid)``)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.deployments.runner import RunnerDeployment
    from prefect.workers.process import ProcessWorker

    from tests.benchmarks.cleanup import spawn  # here: this module is also the flow processes' entrypoint

    name = f"plain-{os.getpid()}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type="process",
                                               base_job_template=ProcessWorker.get_default_base_job_template()))
        deployment = RunnerDeployment.from_flow(plain_job, name="plain", work_pool_name=name)
        deployment.entrypoint = f"{Path(__file__).resolve()}:plain_job"
        deployment_id = deployment.apply(work_pool_name=name)
        for i in range(jobs):
            client.create_flow_run_from_deployment(deployment_id, parameters={
                "src": str(inputs[i % len(inputs)]), "scratch": str(root / "plain-scratch" / f"job-{i:04d}"),
                "dest": str(root / "plain-out" / f"job-{i:04d}"), "work": work, "seconds": work_s})
    server0, cpu0, t0 = tree_cpu(server_pid), machine_cpu(), time.time()
    workers = [spawn([sys.executable, "-m", "prefect", "worker", "start", "--pool", name, "--type", "process",
                      "--limit", "1"], env={**env, "PREFECT_WORKER_QUERY_SECONDS": "1"},
                     stdout=open(root / f"plain-worker-{k}.log", "wb"), stderr=subprocess.STDOUT)
               for k in range(nodes)]
    try:
        records = [root / "plain-out" / f"job-{i:04d}" / "r.json" for i in range(jobs)]
        while not all(r.exists() for r in records):
            time.sleep(1)
            if time.time() - t0 > 3600 * 3:
                raise SystemExit("baseline: gave up after 3 h")
            _stop_on_failure(deployment_id)
        cpu1 = machine_cpu()
        workers_s = sum(tree_cpu(w.pid) for w in workers)
        import json

        ends = [json.loads(r.read_text())["end"] for r in records]
        return {"wall_s": max(ends) - t0, "busy_s": (cpu1[0] - cpu0[0]) if cpu0 and cpu1 else 0.0,
                "steal_s": (cpu1[2] - cpu0[2]) if cpu0 and cpu1 else 0.0,
                "server_s": tree_cpu(server_pid) - server0, "workers_s": workers_s}
    finally:
        for w in workers:
            try:
                os.killpg(w.pid, 15)
            except ProcessLookupError:
                pass
