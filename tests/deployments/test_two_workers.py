"""Beyond one machine, in small: two process workers on one work pool, each
with its own scratch folder (standing in for two machines), take jobs from
the same server; each job stages, runs and returns on the worker that took
it, and neither reads the other's scratch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from tests.conftest import REPO, final_manifest, stop_group

PREFECT = [sys.executable, "-m", "prefect"]


def test_two_workers_each_run_a_job_in_their_own_scratch(prefect_api, e31, tmp_path):
    from prefect.deployments import run_deployment

    pool = f"e31-two-{uuid.uuid4().hex[:6]}"
    subprocess.run([*PREFECT, "work-pool", "create", pool, "--type", "process"], check=True, capture_output=True)
    workers, scratches = [], []
    for i in (1, 2):
        scratch = tmp_path / f"machine-{i}" / "scratch"
        scratches.append(scratch)
        env = {**os.environ, "E31_SCRATCH": str(scratch), "PREFECT_WORKER_QUERY_SECONDS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "flows"), str(REPO)])}
        log = open(tmp_path / f"worker-{i}.log", "wb")
        # --limit 1: a worker runs one flow at a time, so two concurrent jobs need both workers
        workers.append((subprocess.Popen([*PREFECT, "worker", "start", "--pool", pool, "--limit", "1", "--name", f"machine-{i}"],
                                         env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
    try:
        outs = {}
        for job in ("job-a", "job-b"):
            outs[job] = tmp_path / "store" / job  # the shared "object store" both machines reach
            spec = tmp_path / f"{job}.yaml"
            spec.write_text(
                f"name: {job}\nwork: {{kind: simulation, entrypoint: 'stopwork:steps', params: {{n: 25, step_s: 0.2}}}}\n"
                f"data: [{{name: grid, url: {REPO / 'specs/examples/data/sir-grid.json'}}}]\n"
                f"request: {{limit: 2m}}\noutput: {{kind: results, url: {outs[job]}, files: [done.txt]}}\n"
            )
            result = e31("deploy", str(spec), "--pool", pool)
            assert result.returncode == 0, result.stderr
        runs = [run_deployment(f"e31-job/{job}", timeout=0) for job in outs]
        deadline = time.monotonic() + 240
        while not all(final_manifest(out) for out in outs.values()):
            assert time.monotonic() < deadline, [(tmp_path / f"worker-{i}.log").read_text()[-2000:] for i in (1, 2)]
            time.sleep(0.5)
    finally:
        for proc, log in workers:
            stop_group(proc, timeout=20)
            log.close()
    for job, out in outs.items():
        assert final_manifest(out)["status"] == "completed"
    # each job's scratch (staged input, run files) is on exactly one machine, and the two machines differ
    homes = {job: [s for s in scratches if (s / job / "data" / "grid" / "sir-grid.json").is_file()] for job in outs}
    assert all(len(found) == 1 for found in homes.values()), homes
    assert homes["job-a"] != homes["job-b"]
    for job, (home,) in homes.items():
        other = next(s for s in scratches if s != home)
        assert not (other / job).exists()  # never touched on the other machine
    assert len(runs) == 2
