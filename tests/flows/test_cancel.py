"""Cancelling a job through the Prefect API while it runs from a deployment
on a real Prefect server, picked up by a real process worker."""

from __future__ import annotations

import json
import os
import time
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


def test_a_cancel_as_the_output_starts_back_still_returns_it_whole(process_worker, tmp_path):
    """The work ends and cancels its own run as it does (a cancel from the UI
    a moment too late): the work was not stopped, so its output comes back
    whole (``completed``, at the top of the destination), nothing is left
    pending, and the run ends ``Completed`` as its manifest says.  Prefect's
    own process worker (not ``e31 worker``) forces ``Cancelled`` after the
    hooks, which it runs in a process of their own: the run shows it for a
    moment, and E31 sets the manifest's state back."""
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from e31.flows.deploy import deploy_spec
    from e31.specs import parse_spec

    out = tmp_path / "out"
    name = f"cancel-at-return-{uuid.uuid4().hex[:6]}"
    spec = {"name": name, "work": {"kind": "simulation", "entrypoint": "stopwork:cancel_own_run_at_end",
                                    "params": {"run_name": name, "files": 40, "kib": 256}},
            "request": {"limit": "60s", "grace": "2s"},
            "output": {"kind": "results", "url": str(out), "files": ["done.txt"]}}
    deploy_spec(parse_spec(spec), str(HERE), pool=process_worker, name="cancel-at-return")
    flow_run = run_deployment("e31-job/cancel-at-return", parameters={"spec": spec, "code_dir": str(HERE)}, timeout=0)
    with get_client(sync_client=True) as client:
        _wait_for(lambda: client.read_flow_run(flow_run.id).state.is_final(), timeout=120)
        # the worker's cancel ends after the flow process: its hooks (in a process of their own), then its forced
        # Cancelled, which E31 sets back to the manifest's state
        _wait_for(lambda: any(s.type.value == "CANCELLED" for s in client.read_flow_run_states(flow_run.id)),
                  timeout=60)
        _wait_for(lambda: client.read_flow_run(flow_run.id).state.type.value != "CANCELLED", timeout=60)
        state = client.read_flow_run(flow_run.id).state
        history = [(s.type.value, s.name, s.message) for s in client.read_flow_run_states(flow_run.id)]
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["status"], manifest["run_id"]) == ("completed", str(flow_run.id))
    assert sorted(f["path"] for f in manifest["files"]) == sorted(["done.txt"] + [f"blob-{i}.bin" for i in range(40)])
    assert not (out / "partial" / "manifest.json").exists()
    assert list((tmp_path / "worker-scratch").rglob("return-pending.json")) == []
    assert (state.type.value, state.name, state.message) == ("COMPLETED", "Completed", "completed (finished)")
    # Prefect's worker's Cancelled came last of all but E31's, after the flow process had ended Completed
    assert [h[:2] for h in history[-3:]] == [("COMPLETED", "Completed"), ("CANCELLED", "Cancelled"),
                                             ("COMPLETED", "Completed")], history


def test_a_signal_during_the_return_of_a_cancelled_run_does_not_cut_it(prefect_api, scratch, tmp_path):
    """A cancel from the API stops the work and the run returns its output;
    a SIGTERM then (a Prefect worker sends one after every cancel, whenever
    its observer sees it) lands in the middle of that return.  The return
    goes on to its end: the manifest in partial/ is final and lists every
    file, and no pending return is left in scratch."""
    import signal
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.states import Cancelling

    from tests.flows.test_stops import _start_cli

    out = tmp_path / "out"
    name = f"signal-in-return-{uuid.uuid4().hex[:6]}"
    proc = _start_cli(tmp_path, _spec(tmp_path, name, step_s=0.1, blobs=300))
    _wait_for(lambda: len(_durable_steps(out)) >= 1, timeout=120)
    with get_client(sync_client=True) as client:
        run = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))[0]
        client.set_flow_run_state(run.id, Cancelling(), force=True)

    def returning() -> bool:
        try:
            return json.loads((out / "partial" / "manifest.json").read_text())["status"] == "returning"
        except (OSError, ValueError, KeyError):
            return False

    deadline = time.monotonic() + 60
    while not returning():
        assert proc.poll() is None and time.monotonic() < deadline, "the return was not seen under way"
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    manifest = json.loads((out / "partial" / "manifest.json").read_text())
    assert (manifest["status"], manifest["reason"], manifest["run_id"]) == ("partial", "cancelled", str(run.id))
    assert sorted(f["path"] for f in manifest["files"]) == sorted(
        ["pid.txt", "resumed_from.txt", "stopped_at.txt"] + [f"blob-{i}.bin" for i in range(300)])
    assert list(scratch.rglob("return-pending.json")) == []
    assert "e31: returning the output first (kill -9 abandons it)" in stderr
    assert "Traceback" not in stderr
    with get_client(sync_client=True) as client:
        _wait_for(lambda: client.read_flow_run(run.id).state.is_final(), timeout=30)
        assert client.read_flow_run(run.id).state.type.value == "CANCELLED"



def test_a_cancel_and_its_sigterm_between_the_works_end_and_the_return_change_nothing(prefect_api, scratch, tmp_path):
    """``e31 run`` of a command work: the moment its child has exited, before
    the return starts, the flow process is held (a real SIGSTOP), cancelled
    through the API and sent SIGTERM, as a Prefect worker does after a
    cancel; then let go (SIGCONT).  The work had ended by itself: its output
    comes back whole, ``completed``, the run ends ``Completed`` and the
    command exits 0, the signal noted and not obeyed."""
    import signal
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.states import Cancelling

    from tests.flows.test_stops import _pid_gone, _start_cli

    (tmp_path / "ends.py").write_text(
        "import json, os, pathlib\n"
        "out = pathlib.Path(os.environ['E31_OUTPUT_DIR'])\n"
        "for i in range(3):\n"
        "    (out / f'part-{i}.bin').write_bytes(os.urandom(4096))\n"
        "(out / 'record.json').write_text(json.dumps({'pid': os.getpid(), 'flow_pid': os.getppid()}))\n")
    name = f"ends-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "out"
    proc = _start_cli(tmp_path, {"name": name, "work": {"kind": "simulation", "command": [sys.executable, "ends.py"]},
                                 "request": {"limit": "60s", "grace": "2s"},
                                 "output": {"kind": "results", "url": str(out), "files": ["record.json"]}})
    record = scratch / name / "output" / "record.json"
    try:
        deadline = time.monotonic() + 120
        while True:  # the work's record, then its end: the flow process is held at once
            try:
                seen = json.loads(record.read_text())
            except (OSError, ValueError):
                seen = None
            if seen is not None and _pid_gone(seen["pid"]):
                os.kill(seen["flow_pid"], signal.SIGSTOP)
                break
            assert proc.poll() is None and time.monotonic() < deadline, "the work's end was not seen"
            time.sleep(0.001)
        held_manifest = (out / "manifest.json").exists()
        with get_client(sync_client=True) as client:
            run = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))[0]
            client.set_flow_run_state(run.id, Cancelling(message="cancel from the UI"))
        os.kill(seen["flow_pid"], signal.SIGTERM)  # what a worker sends after a cancel
    finally:
        os.kill(seen["flow_pid"], signal.SIGCONT)
    stdout, stderr = proc.communicate(timeout=120)
    assert not held_manifest  # held before the return began
    assert proc.returncode == 0, stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["status"], manifest["reason"], manifest["run_id"]) == ("completed", "finished", str(run.id))
    assert sorted(f["path"] for f in manifest["files"]) == ["part-0.bin", "part-1.bin", "part-2.bin", "record.json"]
    assert not (out / "partial").exists()
    assert list(scratch.rglob("return-pending.json")) == []
    # the signal met the supervisor (the work had ended: never acted on) or the hold for the return (noted)
    rest = stderr.replace("e31: returning the output first (kill -9 abandons it)\n", "")
    assert rest == (
        f"{rest[:12]} | WARNING | Flow run '{name}' - the cancel came after the work had ended; it changes "
        "nothing: the run ends as its manifest says, completed (finished): 4 file(s) at the top of the destination\n")
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.id).state
    assert (state.type.value, state.name) == ("COMPLETED", "Completed")
