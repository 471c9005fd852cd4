"""Tenants in the live queue, against a real ``prefect server start``, ``e31 scheduler`` and ``e31 worker``
(its node told it has 2 GPUs with E31_NODE_GPUS: this machine has none): tenant a fills the node with
preemptible work beyond its quota while tenant b has nothing queued; b's job, within b's quota, takes
back what a borrowed by preempting a's latest-started job, and a's third job waits behind b's."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import final_manifest
from tests.deployments.test_preemption_live import STEPS, _history, _run_id
from tests.deployments.test_queue import queue, wait_for

pytestmark = pytest.mark.server


def _steps_job(q, name: str, steps: int):
    log = q.root / f"{name}-attempts.jsonl"
    spec_path = q.job(name, 1, steps, work="steps.py", preemptible=True, retries=0)
    spec = json.loads(spec_path.read_text())
    spec["work"]["command"].append(str(log))
    spec["request"]["duration"], spec["request"]["limit"] = f"{steps}s", "20m"
    spec_path.write_text(json.dumps(spec))
    return spec_path, log


def _attempts(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_a_tenant_within_its_quota_takes_back_what_another_borrowed(prefect_api, tmp_path):
    with queue(tmp_path, {"n1": 2}) as q:
        pool = json.loads(q.pool.read_text())
        pool["preemption"] = {"min_run": "3s"}
        pool["tenants"] = [{"name": "a", "quota": {"gpus": 1}}, {"name": "b", "quota": {"gpus": 1}}]
        q.pool.write_text(json.dumps(pool))
        (q.root / "steps.py").write_text(STEPS)
        q.scheduler()
        q.worker("n1", 2)
        a = [_steps_job(q, f"a{k}", 400) for k in range(1, 4)]
        ids = {}
        for k, (spec, _) in enumerate(a, start=1):
            ids[f"a{k}"] = _run_id(q.submit(spec, "--tenant", "a"))
            if k < 3:  # a1 then a2 start, a3 waits (the node has two GPUs)
                wait_for(lambda log=a[k - 1][1]: _attempts(log), what=f"a{k}'s work")
        time.sleep(3)  # past the pool's min_run: a2 may now be taken back
        b_spec, b_log = _steps_job(q, "b1", 4)
        submitted = time.time()
        ids["b1"] = _run_id(q.submit(b_spec, "--tenant", "b"))
        wait_for(lambda: final_manifest(q.root / "out" / "b1") is not None, timeout=120, what="b1's output")
        b_start = _attempts(b_log)[0]["start"]
        b_manifest = final_manifest(q.root / "out" / "b1")
        a_runs = {name: _attempts(log) for name, (_, log) in zip(("a1", "a2", "a3"), a)}
        a2_states = _history(ids["a2"])
        a2_history = [name for _, _, name, _ in a2_states]
        a1_history = [name for _, _, name, _ in _history(ids["a1"])]
        a3_history = [(at, name) for at, _, name, _ in _history(ids["a3"])]
    assert (b_manifest["status"], b_manifest["tenant"]) == ("completed", "b")
    # b's work started within the grace (the default 30 s) + 10 s of its submission
    assert b_start - submitted <= 40, (b_start, submitted)
    # a2, the latest-started of a's jobs, beyond a's quota, was the one taken back; a1, within it, never
    assert "Preempting" in a2_history and "Preempted" in a2_history, a2_history
    assert "Preempting" not in a1_history, a1_history
    why = next(message for _, _, name, message in a2_states if name == "Preempting")
    assert why.startswith(f"preempted by b1 ({ids['b1'][:8]}): tenant b takes back, within its quota, what tenant a "
                          "borrowed; at "), why
    stopped = next(line["stopped"] for line in a_runs["a2"] if "stopped" in line)
    assert stopped <= b_start  # never two works on one device
    # while b waited and ran, a never held more than its quota: a3 did not start before b's work had
    started = [line["start"] for line in a_runs["a3"] if "start" in line]
    assert not started or started[0] >= b_start, (started, b_start, a3_history)
