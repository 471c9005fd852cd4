"""Every way a run can end early returns the latest result (issue: time
limit, deadline, signals, crashes, kills, retries).  Real child processes,
real signals, the real Prefect engine against a real server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
import yaml

from e31.flows.job import JobFailedError, run_job
from e31.specs import parse_spec
from e31.tasks.work.local_checkpoints import MARKER, STATE_FILE, load_state
from tests.conftest import final_manifest

HERE = Path(__file__).resolve().parent


def _spec(tmp_path: Path, name: str, limit: str = "60s", grace: str = "2s", **params) -> dict:
    return {
        "name": name,
        "work": {"kind": "simulation", "entrypoint": "stopwork:steps", "params": params},
        "request": {"limit": limit, "grace": grace},
        "output": {"kind": "results", "url": str(tmp_path / "out"), "files": ["done.txt"]},
    }


def _durable_steps(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*") if (p / MARKER).is_file())


def _assert_returned_checkpoint(out: Path, manifest: dict) -> None:
    """The manifest's checkpoint is the newest durable one and holds its step."""
    steps = _durable_steps(out)
    assert steps and manifest["step"] == steps[-1]
    assert manifest["checkpoint"] == str(out / "checkpoints" / f"step-{steps[-1]}")
    state = load_state(out / "checkpoints" / f"step-{steps[-1]}" / STATE_FILE)
    assert int(state["step"]) == manifest["step"]
    assert torch.equal(state["w"], torch.full((256,), float(manifest["step"])))


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0); it is gone once reaped or defunct
    # (reaped between the two looks: the file is gone by the time it is read)
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_time_limit_warns_then_returns_the_final_checkpoint(prefect_api, scratch, tmp_path):
    # a grace of 4 s: the work's final checkpoint and return fit it also on a loaded machine (2 s did not)
    spec = parse_spec(_spec(tmp_path, "limit-coop", limit="8s", grace="4s", every=5, step_s=0.1))
    manifest = run_job(spec, code_dir=str(HERE))
    assert (manifest["status"], manifest["reason"]) == ("partial", "time_limit")
    assert manifest["message"] == "stopped early (time_limit)"  # saved and returned within the grace period
    # checkpoints every 5 steps, plus the one the work saved when warned: that one came back
    assert manifest["step"] == int((tmp_path / "out" / "partial" / "stopped_at.txt").read_text())
    _assert_returned_checkpoint(tmp_path / "out", manifest)
    assert 3.0 <= manifest["timings"]["run_s"] <= 8.5  # warned at 4 s (the limit less the grace), ended by itself
    assert [f["path"] for f in manifest["files"]] == ["pid.txt", "resumed_from.txt", "stopped_at.txt"]
    state = _flow_run_state(manifest["run_id"])  # a partial job is told apart from a whole one in the UI
    assert (state.type.value, state.name) == ("COMPLETED", "Partial")
    assert state.message == f"partial (time_limit): step {manifest['step']}; stopped early (time_limit)"


def _flow_run_state(run_id: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id).state


def _artifacts(run_id: str) -> dict:
    """``{key: data}`` of the flow run's artifacts (table data parsed)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    return {a.key: json.loads(a.data) if isinstance(a.data, str) and a.type == "table" else a.data for a in found}


def test_cancel_of_a_local_run_ends_cancelled_with_the_manifest_in_the_ui(prefect_api, scratch, tmp_path):
    """Cancelling an `e31 run` from the UI must not leave the flow run
    Cancelling forever with no manifest artifact.  The partial output
    comes back, e31 exits 3, the run ends Cancelled and the manifest and
    output artifacts are there."""
    out = tmp_path / "out"
    proc = _start_cli(tmp_path, _spec(tmp_path, "local-cancel", limit="5m", step_s=0.1))
    _wait_for(lambda: len(_durable_steps(out)) >= 1)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["local-cancel"])))
    run_id = str(run.id)
    subprocess.run([sys.executable, "-m", "prefect", "flow-run", "cancel", run_id], check=True, capture_output=True)
    stdout, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 3, stderr
    manifest = json.loads((out / "partial" / "manifest.json").read_text())
    assert (manifest["status"], manifest["reason"], manifest["run_id"]) == ("partial", "cancelled", run_id)
    _assert_returned_checkpoint(out, manifest)
    _wait_for(lambda: _flow_run_state(run_id).type.value == "CANCELLED", timeout=20)
    assert _flow_run_state(run_id).message == (  # the cancel hook's word: what came back, where
        f"cancelled: E31 stopped the work and returned what it had, partial: {len(manifest['files'])} file(s) in "
        "partial/ at the destination (see the manifest there)")
    artifacts = _artifacts(run_id)
    assert {"manifest", "output", "job-spec"} <= set(artifacts)
    assert {(row["status"], row["reason"], row["step"]) for row in artifacts["manifest"]} == {
        ("partial", "cancelled", manifest["step"])}
    assert "Traceback" not in stderr


@pytest.mark.parametrize("how", ["ignore_stop", "block_after"])
def test_time_limit_kills_work_that_ignores_the_warning(prefect_api, scratch, tmp_path, how):
    params = {"ignore_stop": True, "n": 3, "step_s": 0.1} if how == "ignore_stop" else {"block_after": 3, "step_s": 0.1}
    if how == "ignore_stop":
        params.update(n=10_000)  # keeps stepping, never looks at should_stop
    spec = parse_spec(_spec(tmp_path, f"limit-{how.replace('_', '-')}", limit="6s", grace="2s", **params))
    manifest = run_job(spec, code_dir=str(HERE))
    assert (manifest["status"], manifest["reason"]) == ("partial", "time_limit")
    assert manifest["message"] == "stopped early (time_limit); killed after the grace period"
    assert manifest["exit_code"] == -signal.SIGKILL
    _assert_returned_checkpoint(tmp_path / "out", manifest)
    if how == "block_after":
        assert manifest["step"] == 3  # blocked in time.sleep(3600) after step 3, stopped on time anyway
    # killed at the limit (6 s after the run task's start), not at the warning (4 s): run_s counts from the
    # child's spawn, which a loaded machine delays by a second or more after the limit's clock started
    assert 4.5 <= manifest["timings"]["run_s"] <= 7.0
    assert _pid_gone(int((tmp_path / "out" / "partial" / "pid.txt").read_text()))


def test_deadline_stops_before_it_with_the_return_reserve(prefect_api, scratch, tmp_path, monkeypatch):
    monkeypatch.setenv("E31_RETURN_RESERVE_S", "3")
    deadline = datetime.now(timezone.utc) + timedelta(seconds=16)
    raw = _spec(tmp_path, "deadline", limit="10m", grace="2s", step_s=0.1)
    raw["request"]["deadline"] = deadline.isoformat()
    manifest = run_job(parse_spec(raw), code_dir=str(HERE))
    assert (manifest["status"], manifest["reason"]) == ("partial", "deadline")
    _assert_returned_checkpoint(tmp_path / "out", manifest)
    arrived = datetime.fromtimestamp((tmp_path / "out" / "partial" / "manifest.json").stat().st_mtime, timezone.utc)
    assert deadline - timedelta(seconds=6) <= arrived <= deadline - timedelta(seconds=2)


def test_a_deadline_too_close_to_start_names_its_field_and_times(prefect_api, scratch, tmp_path, monkeypatch):
    """The refusal names request.deadline_within (not request.deadline) for
    a deadline_within, and gives the times.  deadline_within 20s with a 30 s
    return reserve cannot start; nothing runs, and a failed manifest (no
    files, the refusal as its message) says why at the destination, in ``partial/``."""
    import re

    from e31.flows.admission import AdmissionError

    monkeypatch.setenv("E31_RETURN_RESERVE_S", "30")
    raw = _spec(tmp_path, "too-close", limit="10m", grace="2s", step_s=0.1)
    raw["request"]["deadline_within"] = "20s"
    with pytest.raises(AdmissionError) as err:
        run_job(parse_spec(raw), code_dir=str(HERE))
    utc = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00"
    assert re.fullmatch(
        rf"request.deadline_within: the deadline ({utc}) \(within 0:00:20 of the scheduled start\) leaves no time to "
        rf"run: the work would have to stop by ({utc}) \(30 s before it, to return the output\) and it is ({utc}), "
        r"with 2 s of grace; give a later deadline or start the job sooner", str(err.value)), str(err.value)
    deadline, stop, now = (datetime.fromisoformat(t) for t in re.findall(utc, str(err.value)))
    assert deadline - stop == timedelta(seconds=30) and timedelta(0) <= deadline - now <= timedelta(seconds=21)
    assert not (tmp_path / "out" / "pid.txt").exists()
    said = json.loads((tmp_path / "out" / "partial" / "manifest.json").read_text())
    assert (said["status"], said["reason"], said["files"], said["message"]) == ("failed", "error", [], str(err.value))
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("crash, code", [("exit", 1), ("segfault", -signal.SIGSEGV), ("raise", 1)])
def test_crashed_work_fails_with_exit_code_and_returns_checkpoint(prefect_api, scratch, tmp_path, crash, code):
    spec = parse_spec(_spec(tmp_path, f"crash-{crash}", crash_after=3, crash=crash, step_s=0.05))
    with pytest.raises(JobFailedError) as err:
        run_job(spec, code_dir=str(HERE))
    manifest = err.value.manifest
    assert (manifest["status"], manifest["reason"], manifest["exit_code"]) == ("failed", "error", code)
    assert manifest["message"] == f"work exited with code {code}"
    assert manifest["step"] == 3
    _assert_returned_checkpoint(tmp_path / "out", manifest)
    if crash == "raise":
        assert manifest["stderr_tail"].endswith("RuntimeError: work raised on purpose")


def test_out_of_memory_kill_without_retries_fails_with_checkpoint(prefect_api, scratch, tmp_path):
    spec = parse_spec(_spec(tmp_path, "oom", crash_after=3, crash="sigkill", step_s=0.05))
    with pytest.raises(JobFailedError) as err:
        run_job(spec, code_dir=str(HERE))
    manifest = err.value.manifest
    assert (manifest["status"], manifest["reason"], manifest["exit_code"]) == ("failed", "error", -signal.SIGKILL)
    assert manifest["message"] == "work process killed by SIGKILL (out of memory, or killed outside E31)"
    _assert_returned_checkpoint(tmp_path / "out", manifest)
    assert manifest["step"] == 3


def test_lost_process_is_retried_and_resumes_from_newest_checkpoint(prefect_api, scratch, tmp_path):
    raw = _spec(tmp_path, "retried", crash_after=4, crash="sigkill", step_s=0.05, n=8)
    raw["request"]["retries"] = 1
    manifest = run_job(parse_spec(raw), code_dir=str(HERE))
    assert (manifest["status"], manifest["reason"], manifest["step"]) == ("completed", "finished", 8)
    assert (tmp_path / "out" / "resumed_from.txt").read_text() == "4"


def test_work_exception_is_not_retried(prefect_api, scratch, tmp_path):
    raw = _spec(tmp_path, "not-retried", crash_after=2, crash="raise", step_s=0.05, n=5)
    raw["request"]["retries"] = 2
    with pytest.raises(JobFailedError):
        run_job(parse_spec(raw), code_dir=str(HERE))
    assert (tmp_path / "out" / "partial" / "resumed_from.txt").read_text() == "0"  # ran once, from scratch


def _start_cli(tmp_path: Path, spec: dict, *extra: str) -> subprocess.Popen:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    shutil_e31 = str(Path(sys.executable).with_name("e31"))
    return subprocess.Popen(
        [shutil_e31, "run", str(path), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(HERE)},
    )


def _wait_for(predicate, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_flow_process_returns_partial(prefect_api, scratch, tmp_path, sig):
    out = tmp_path / "out"
    proc = _start_cli(tmp_path, _spec(tmp_path, f"signal-{sig.name.lower()}", step_s=0.1))
    _wait_for(lambda: len(_durable_steps(out)) >= 1)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 3, stderr
    manifest = json.loads((out / "partial" / "manifest.json").read_text())
    assert (manifest["status"], manifest["reason"]) == ("partial", "signal")
    _assert_returned_checkpoint(out, manifest)
    assert f"partial (signal): signal-{sig.name.lower()} -> {out}" in stdout
    assert "Traceback" not in stderr
    assert _pid_gone(int((out / "partial" / "pid.txt").read_text()))


def test_killed_flow_process_resumes_on_the_next_attempt(prefect_api, scratch, tmp_path):
    out = tmp_path / "out"
    raw = _spec(tmp_path, "flow-killed", step_s=0.1, n=40)
    proc = _start_cli(tmp_path, raw)
    _wait_for(lambda: len(_durable_steps(out)) >= 1 and max(_durable_steps(out)) >= 3)
    proc.kill()  # SIGKILL: no code of the flow process runs
    proc.communicate(timeout=30)
    child = int((out / "pid.txt").read_text()) if (out / "pid.txt").exists() else None
    _wait_for(lambda: child is None or _pid_gone(child), timeout=10)  # the child died with its supervisor
    assert not (out / "manifest.json").exists()
    newest = max(_durable_steps(out))

    # An attempt that can no longer run (its deadline, less the 30 s return reserve, has passed)
    # returns the newest checkpoint as partial, reason crashed.
    soon = (datetime.now(timezone.utc) + timedelta(seconds=20)).isoformat()
    too_late = _start_cli(tmp_path, raw, "--set", f"request.deadline={soon}")
    stdout, stderr = too_late.communicate(timeout=120)
    assert too_late.returncode == 3, stderr
    manifest = json.loads((out / "partial" / "manifest.json").read_text())
    assert (manifest["status"], manifest["reason"]) == ("partial", "crashed")
    assert manifest["step"] >= newest
    _assert_returned_checkpoint(out, manifest)

    # The next attempt with time to run resumes from the newest valid checkpoint and completes.
    again = _start_cli(tmp_path, raw)
    stdout, stderr = again.communicate(timeout=120)
    assert again.returncode == 0, stderr
    resumed = int((tmp_path / "out" / "resumed_from.txt").read_text())
    assert resumed >= newest
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["status"], manifest["step"]) == ("completed", 40)


def test_work_that_finishes_in_the_grace_period_without_seeing_the_warning_completes(prefect_api, scratch, tmp_path):
    spec = parse_spec(_spec(tmp_path, "finishes-in-grace", limit="40s", grace="37s", ignore_stop=True, n=30, step_s=0.1))
    manifest = run_job(spec, code_dir=str(HERE))
    assert manifest["stop_requested_at"] is not None  # the warning went out ...
    assert (manifest["status"], manifest["reason"], manifest["step"]) == ("completed", "finished", 30)  # ... unseen


def test_a_changed_work_does_not_resume_from_another_works_checkpoints(prefect_api, tmp_path, monkeypatch):
    out = tmp_path / "out"

    def attempt(scratch_name: str, limit: str, n: int) -> dict:
        monkeypatch.setenv("E31_SCRATCH", str(tmp_path / scratch_name))
        return run_job(parse_spec(_spec(tmp_path, "changed", limit=limit, grace="2s", step_s=0.1, n=n)), code_dir=str(HERE))

    first = attempt("scratch-a", "5s", 60)
    assert first["status"] == "partial" and 1 <= first["step"] < 60
    # another machine (fresh scratch): the same work resumes from the durable checkpoint ...
    same = attempt("scratch-b", "60s", 60)
    assert same["status"] == "completed" and (out / "resumed_from.txt").read_text() == str(first["step"])
    # ... but after a partial run, changed params on a third machine start from scratch
    assert attempt("scratch-c", "5s", 60)["status"] == "partial"
    other = attempt("scratch-d", "60s", 61)
    assert other["status"] == "completed" and (out / "resumed_from.txt").read_text() == "0"


@pytest.mark.server  # `e31 run` starts a temporary Prefect server
def test_ctrl_c_to_the_whole_process_group_with_the_temporary_server(scratch, tmp_path):
    """As a terminal's Ctrl-C: SIGINT to e31 and every process of its group, with no
    PREFECT_API_URL (e31 starts its own temporary server, outside the group)."""
    out = tmp_path / "out"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_spec(tmp_path, "ctrl-c", step_s=0.1)))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PYTHONPATH=str(HERE), PREFECT_HOME=str(tmp_path / "prefect-home"))
    proc = subprocess.Popen([str(Path(sys.executable).with_name("e31")), "run", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    _wait_for(lambda: len(_durable_steps(out)) >= 2, timeout=150)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 3, stderr
    manifest = json.loads((out / "partial" / "manifest.json").read_text())
    assert (manifest["status"], manifest["reason"]) == ("partial", "signal")
    _assert_returned_checkpoint(out, manifest)
    assert "Traceback" not in stderr


def test_next_attempt_kills_what_a_killed_flow_left_running(prefect_api, scratch, tmp_path):
    raw = _spec(tmp_path, "leftovers")
    raw["work"] = {"kind": "processing", "command": [
        "bash", "-c", 'sleep 3600 & echo $! > "$E31_OUTPUT_DIR/grandchild.pid"; wait']}
    proc = _start_cli(tmp_path, raw)
    # the file is created empty before echo writes the pid and its newline: wait for the whole line
    _wait_for(lambda: any(p.read_text().endswith("\n") for p in scratch.glob("*/output/grandchild.pid")), timeout=90)
    grandchild = int(next(scratch.glob("*/output/grandchild.pid")).read_text())
    proc.kill()
    proc.communicate(timeout=30)
    time.sleep(1)
    assert not _pid_gone(grandchild)  # a command's own child outlives a kill -9 of the supervisor
    raw["work"]["command"] = [sys.executable, "-c", "import os, pathlib; pathlib.Path(os.environ['E31_OUTPUT_DIR'], 'done.txt').write_text('x')"]
    again = _start_cli(tmp_path, raw)
    stdout, stderr = again.communicate(timeout=120)
    assert again.returncode == 0, stderr
    _wait_for(lambda: _pid_gone(grandchild), timeout=5)  # the next attempt cleaned it up


def test_cancel_while_inputs_stage_keeps_the_earlier_checkpoints_and_runs_nothing(prefect_api, scratch, tmp_path):
    """A cancel during a slow download must not let the work start once
    staging ends, nor the fresh run remove the earlier run's durable
    checkpoints.  The download is stopped (it would take 30 s: 64 KiB a
    second), the work never starts, nothing is removed, no partial copy is
    left, and the manifest says what happened."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from tests.slowhttp import slow_server

    server, _ = slow_server()
    out = tmp_path / "out"
    earlier = out / "checkpoints" / "step-2"
    earlier.mkdir(parents=True)
    (earlier / "state.pt").write_bytes(b"older run")
    (earlier / MARKER).write_text(json.dumps({"step": 2, "files": {"state.pt": {"bytes": 9, "sha256": "0" * 64}},
                                              "work_sha256": "older"}))
    spec = _spec(tmp_path, "cancel-staging", step_s=0.1)
    spec["data"] = [{"name": "inp", "url": f"http://127.0.0.1:{server.server_address[1]}/inputs.txt"}]
    try:
        proc = _start_cli(tmp_path, spec)
        run_filter = FlowRunFilter(name=FlowRunFilterName(any_=["cancel-staging"]))

        def started() -> bool:
            with get_client(sync_client=True) as client:
                return bool(client.read_flow_runs(flow_run_filter=run_filter))

        _wait_for(started, timeout=60)
        with get_client(sync_client=True) as client:
            (run,) = client.read_flow_runs(flow_run_filter=run_filter)
        time.sleep(3)  # staging under way
        subprocess.run([sys.executable, "-m", "prefect", "flow-run", "cancel", str(run.id)], check=True,
                       capture_output=True)
        cancelled_at = time.monotonic()
        stdout, stderr = proc.communicate(timeout=90)
        ended_s = time.monotonic() - cancelled_at
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 3, stderr
    manifest = json.loads((out / "partial" / "manifest.json").read_text())
    assert (manifest["status"], manifest["reason"], manifest["files"]) == ("partial", "cancelled", [])
    assert manifest["message"] == "cancelled while the inputs were staged; the work did not start"
    assert (earlier / "state.pt").read_bytes() == b"older run"
    assert not (out / "partial" / "pid.txt").exists()  # the work never ran
    assert ended_s < 15, ended_s  # the download alone had about 25 s to go
    assert not list(scratch.glob("*/data/.inp.part-*")) and not list(scratch.glob("*/data/inp"))
    _wait_for(lambda: _flow_run_state(str(run.id)).type.value == "CANCELLED", timeout=20)
    assert _flow_run_state(str(run.id)).message == ("cancelled while the inputs were staged; the work did not "
                                                    "start; its manifest (partial, 0 file(s)) is in partial/ at the "
                                                    "destination")


def test_a_signal_after_the_output_is_returned_does_not_change_the_exit_code(prefect_api, scratch, tmp_path):
    """A SIGTERM reaching `e31 run` within about a second after a completed
    manifest is written must not kill it with exit 143; nor may one in the
    interpreter's exit, where CPython resets Python signal handlers."""
    out = tmp_path / "out"
    proc = _start_cli(tmp_path, _spec(tmp_path, "late-signal", n=3, step_s=0.05))
    _wait_for(lambda: final_manifest(out), timeout=120)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:  # to the last instant, the interpreter's exit included
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.01)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert json.loads((out / "manifest.json").read_text())["status"] == "completed"
    assert stdout.startswith(f"completed (finished): late-signal -> {out}")
