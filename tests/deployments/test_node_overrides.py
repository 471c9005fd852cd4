"""A pool node larger than this machine, tried with E31_NODE_CPUS and E31_NODE_MEMORY: the worker takes
them as found, and so does the run it starts, which is admitted as the pool file placed it (real server,
scheduler and worker)."""

from __future__ import annotations

import json

from tests.conftest import final_manifest
from tests.deployments.test_queue import queue, wait_for


def test_a_job_as_large_as_the_declared_node_runs_with_the_overrides(prefect_api, tmp_path):
    with queue(tmp_path, {"big": 0}) as q:
        q.pool.write_text(json.dumps({"pool_version": 1, "name": q.name, "nodes": [
            {"name": "big", "gpus": 0, "cpus": 64, "memory": "512GiB"}]}))
        q.scheduler()
        q.start("worker-big", "worker", "--pool", str(q.pool), "--node", "big",
                env={"E31_NODE_GPUS": "0", "E31_NODE_CPUS": "64", "E31_NODE_MEMORY": "512GiB",
                     "E31_SCRATCH": str(tmp_path / "scratch-big")})
        q.submit(q.job("wide", 0, 1, cpus=64, memory="400GiB"))
        wait_for(lambda: final_manifest(tmp_path / "out" / "wide") is not None, timeout=240, what="the wide job")
        manifest = final_manifest(tmp_path / "out" / "wide")
    assert (manifest["status"], manifest["reason"]) == ("completed", "finished"), manifest
    assert q.record("wide")["node"] == "big"
