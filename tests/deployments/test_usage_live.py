"""``e31 usage`` against a real server, scheduler and worker: every figure is the sum of the runs'
manifests; a failed run, a run still going and a pool with no runs; each output format."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess

import pytest

from tests.conftest import final_manifest
from tests.deployments.test_queue import queue, wait_for

pytestmark = pytest.mark.server

FAIL = "import sys, time\ntime.sleep(float(sys.argv[1]))\nsys.exit(3)\n"


def _usage(q, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([q.exe, "usage", "--pool", str(q.pool), *args], capture_output=True, text=True, cwd=q.root)


def test_e31_usage_sums_the_manifests_by_tenant_job_and_day(prefect_api, tmp_path):
    with queue(tmp_path, {"n1": 2}) as q:
        pool = json.loads(q.pool.read_text())
        pool["tenants"] = [{"name": "a", "quota": {"gpus": 1}}, {"name": "b", "quota": {"gpus": 1},
                                                                     "borrow_limit": {"gpus": 0}}]
        q.pool.write_text(json.dumps(pool))
        (q.root / "fail.py").write_text(FAIL)
        empty = _usage(q)
        assert (empty.returncode, empty.stdout.splitlines()[1:]) == (0, ["  no run of the pool ended or ran in the period"])
        q.scheduler()
        q.worker("n1", 2)
        q.submit(q.job("a1", 1, 1), "--tenant", "a")
        q.submit(q.job("b1", 1, 1, work="fail.py"), "--tenant", "b")
        q.submit(q.job("b2", 2, 1), "--tenant", "b")  # past b's quota and borrow limit: refused, no attempt
        wait_for(lambda: final_manifest(q.root / "out" / "a1") is not None, what="a1's manifest")
        wait_for(lambda: final_manifest(q.root / "out" / "b1" / "partial") is not None, what="b1's manifest")
        q.submit(q.job("a2", 1, 120), "--tenant", "a")
        wait_for(lambda: (q.root / "out" / "a2" / "started.json").exists() or any(
            (q.root / "scratch-n1").glob("a2/**/started.json")), what="a2's work")
        q.submit(q.job("a3", 2, 1), "--tenant", "a")  # both GPUs: it waits for a2, queued, holding nothing
        a1, b1 = final_manifest(q.root / "out" / "a1"), final_manifest(q.root / "out" / "b1" / "partial")
        wait_for(lambda: json.loads(_usage(q, "--json").stdout)["rows"][0].get("completed") == 1,
                 what="a1's manifest artifact")  # the artifact is made a moment after the manifest
        wait_for(lambda: {r["key"]: r for r in json.loads(_usage(q, "--json").stdout)["rows"]}["b"]["failed"] == 2,
                 what="b2's refusal")
        wait_for(lambda: final_manifest(q.root / "out" / "b2" / "partial") is not None, what="b2's manifest")
        b2 = final_manifest(q.root / "out" / "b2" / "partial")  # written just after its state
        by_tenant = json.loads(_usage(q, "--json").stdout)
        by_job = json.loads(_usage(q, "--json", "--by", "job").stdout)
        by_day = _usage(q, "--csv", "--by", "day")
        table = _usage(q, "--png", str(tmp_path / "usage.png"))
    assert (a1["status"], a1["tenant"], b1["status"], b1["tenant"]) == ("completed", "a", "failed", "b")
    assert (b2["status"], b2["tenant"], b2["files"]) == ("failed", "b", [])  # refused: said at its destination
    rows = {r["key"]: r for r in by_tenant["rows"]}
    assert (rows["a"]["gpu_seconds"], rows["a"]["cpu_seconds"]) == (a1["meter"]["gpu_seconds"], a1["meter"]["cpu_seconds"])
    assert rows["a"]["gpu_hours"] == round(a1["meter"]["gpu_seconds"] / 3600, 6)
    assert (rows["a"]["completed"], rows["a"]["running"], rows["a"]["queued"], rows["a"]["failed"]) == (1, 1, 1, 0)
    assert rows["b"]["gpu_seconds"] == b1["meter"]["gpu_seconds"]
    assert (rows["b"]["failed"], rows["b"]["completed"], rows["b"]["running"]) == (2, 0, 0)  # b1 and b2
    total = by_tenant["total"]
    assert total["gpu_seconds"] == round(a1["meter"]["gpu_seconds"] + b1["meter"]["gpu_seconds"], 3)
    assert (total["completed"], total["failed"], total["running"], total["queued"], total["redone_gpu_hours"]) == (
        1, 2, 1, 1, 0.0)
    assert {r["key"]: (r["failed"], r["running"], r["queued"]) for r in by_job["rows"]} == {
        "a1": (0, 0, 0), "b1": (1, 0, 0), "b2": (1, 0, 0), "a2": (0, 1, 0), "a3": (0, 0, 1)}
    day = list(csv.reader(io.StringIO(by_day.stdout)))
    assert day[0] == ["day", "gpu_seconds", "cpu_seconds", "gpu_hours", "cpu_hours", "redone_gpu_hours", "completed",
                      "partial", "failed", "running", "queued", "mean_wait_s"]
    assert len(day) == 2 and float(day[1][1]) == total["gpu_seconds"]
    lines = table.stdout.splitlines()
    assert re.fullmatch(r"pool q[0-9a-f]{8}: usage since \d{4}-\d\d-\d\d \d\d:\d\d UTC \(the last 7d\), by tenant",
                        lines[0]), lines[0]
    assert lines[1].split() == ["TENANT", "GPU-H", "CPU-H", "REDONE", "GPU-H", "DONE", "PARTIAL", "FAILED", "RUNNING",
                                "QUEUED", "MEAN", "WAIT"]
    assert lines[-1].split()[:2] == ["total", f"{total['gpu_seconds'] / 3600:.3f}"]
    assert (tmp_path / "usage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table.stderr == f"e31 usage: wrote the chart of GPU-hours per tenant per day to {tmp_path / 'usage.png'}\n"


def test_fair_share_usage_counts_a_preempted_runs_run_time_not_its_wait_between_attempts(prefect_api, tmp_path):
    """A run preempted and queued again ends with Prefect's ``start_time`` at its first attempt and
    ``end_time`` at its last: the usage fair share weighs (``read_usage``) is its run time, the sum of
    its ``Running`` spells (about 2 s here), not the 2 s plus the 4 s it waited between them.  The
    states are set by hand, as the queue sets them (no scheduler or worker runs)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Completed, Running, Scheduled

    from e31.flows.queue.usage import read_usage
    from e31.prefect_compat import clock
    from e31.specs.pool import load_pool

    with queue(tmp_path, {"n1": 2}) as q:
        pool = json.loads(q.pool.read_text())
        pool["tenants"] = [{"name": "a", "quota": {"gpus": 1}}]
        q.pool.write_text(json.dumps(pool))
        run_id = q.submit(q.job("twice", 1, 1), "--tenant", "a").split("flow run ")[1].split()[0]
        with get_client(sync_client=True) as client:
            for state, hold in ((Running(), 1.0), (Cancelled(name="Preempted"), 0.0), (Scheduled(name="Queued"), 4.0),
                                (Running(), 1.0), (Completed(), 0.0)):
                assert client.set_flow_run_state(run_id, state, force=True).status.value == "ACCEPT"
                time.sleep(hold)
            run = client.read_flow_run(run_id)
            clock.measure(client)
            usage, _ = read_usage(client, load_pool(q.pool), clock.server_now())
            # the server's clock as estimated from a busy server's stale Date headers: 1.5 s early
            early, _ = read_usage(client, load_pool(q.pool), run.end_time.timestamp() - 1.5)
    ran, span = run.total_run_time.total_seconds(), (run.end_time - run.start_time).total_seconds()
    assert span > ran + 3.5  # the wait between the attempts lies between start_time and end_time
    assert usage["a"][0] == pytest.approx(ran, rel=1e-4)  # 1 GPU x its run time, decayed over a second or so
    assert early["a"][0] == pytest.approx(ran, rel=1e-4)  # all of it, though "now" seemed before its end
