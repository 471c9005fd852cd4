"""Cancelling a job through the Prefect API while it runs from a deployment
on a real Prefect server, picked up by a real process worker."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from tests.conftest import final_manifest
from tests.flows.test_stops import _artifacts, _assert_returned_checkpoint, _durable_steps, _pid_gone, _spec, _wait_for

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PREFECT = [sys.executable, "-m", "prefect"]


def test_cancel_from_the_api_returns_partial_and_stops_the_child(process_worker, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    out = tmp_path / "out"
    from e31.flows.deploy import deploy_spec
    from e31.specs import parse_spec

    deploy_spec(parse_spec(_spec(tmp_path, "cancelled-job")), str(HERE), pool=process_worker, name="cancel-test")
    spec = _spec(tmp_path, "cancelled-job", limit="10m", grace="3s", step_s=0.1)
    flow_run = run_deployment("e31-job/cancel-test", parameters={"spec": spec, "code_dir": str(HERE)}, timeout=0)
    _wait_for(lambda: len(_durable_steps(out)) >= 2, timeout=120)
    cancelled_at = datetime.now(timezone.utc)
    subprocess.run([*PREFECT, "flow-run", "cancel", str(flow_run.id)], check=True, capture_output=True)
    _wait_for(lambda: final_manifest(out / "partial"), timeout=60)
    returned_at = datetime.now(timezone.utc)

    manifest = json.loads((out / "partial" / "manifest.json").read_text())
    assert (manifest["status"], manifest["reason"]) == ("partial", "cancelled")
    assert manifest["run_id"] == str(flow_run.id)
    _assert_returned_checkpoint(out, manifest)
    assert (returned_at - cancelled_at).total_seconds() < 3 + 2 + 5  # cancel poll + grace + return
    child = int((out / "partial" / "pid.txt").read_text())
    _wait_for(lambda: _pid_gone(child), timeout=5)

    with get_client(sync_client=True) as client:
        _wait_for(lambda: client.read_flow_run(flow_run.id).state.is_final(), timeout=60)
        assert client.read_flow_run(flow_run.id).state.type.value == "CANCELLED"
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    artifacts = _artifacts(str(flow_run.id))  # the run task delivered the output itself: its artifacts too
    assert {(row["status"], row["reason"]) for row in artifacts["manifest"]} == {("partial", "cancelled")}
    assert "output" in artifacts
    names = sorted(t.name for t in task_runs)
    assert "return" not in names  # no task starts after the cancel: the run task returned the output itself
    assert "run" in names and "stage" not in " ".join(names)  # no inputs declared
    for t in task_runs:
        # checkpoint tasks may start until the run task sees the cancel (one 2 s poll on an idle machine; 4.2 s
        # was seen with both cores busy), none once it has returned the output: an order, not a speed
        assert t.start_time is None or t.start_time <= returned_at
