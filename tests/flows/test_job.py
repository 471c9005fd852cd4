"""The main job end to end on the real Prefect engine (a real
``prefect server start``), real torch training on the real digits data."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from e31.examples.digits import build_model, evaluate, load_digits_csv, split
from e31.flows.job import JobFailedError, run_job
from e31.specs import load_spec, parse_spec
from e31.tasks.work.local_checkpoints import MARKER, STATE_FILE, load_state

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "specs" / "examples" / "digits-nightly-retrain.yaml"
DIGITS = REPO / "specs" / "examples" / "data" / "digits.csv.gz"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _durable_steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / MARKER).is_file())


@pytest.mark.slow
def test_example_job_trains_and_returns_model(prefect_api, scratch, tmp_path):
    out = tmp_path / "out"
    spec = load_spec(EXAMPLE, overrides=[f"output.url={out}"])
    manifest = run_job(spec)

    assert manifest["status"] == "completed" and manifest["reason"] == "finished"
    assert manifest["job"] == "digits-nightly-retrain" and manifest["exit_code"] == 0
    assert manifest["step"] == 30
    assert manifest["checkpoint"] == str(out / "checkpoints" / "step-30")
    assert [f["path"] for f in manifest["files"]] == ["metrics.json", "model.pt"]
    for f in manifest["files"]:
        assert f["sha256"] == _sha(out / f["path"]) and f["bytes"] == (out / f["path"]).stat().st_size
    assert json.loads((out / "manifest.json").read_text()) == manifest
    timings = manifest["timings"]
    assert set(timings) == {"prefetch_s", "staging_s", "run_s", "child_start_s", "work_s", "settle_s", "prestart_s",
                            "return_s"}
    assert timings["prefetch_s"] == 0.0 and manifest["staged_before_allocation"] is False  # staged in the run
    # the child's phases lie within run_s (rounding to ms aside); settle_s comes after the child's exit
    assert timings["child_start_s"] + timings["work_s"] <= timings["run_s"] + 0.01
    assert timings["child_start_s"] > 0 and timings["work_s"] > 0
    assert timings["prestart_s"] > 0  # the child was started before staging and waited for its go
    meter = manifest["meter"]  # from the work's start (after the child's start) to the release
    assert meter["gpu_seconds"] == 0 and meter["cpu_seconds"] == meter["seconds"]  # cpus: 1
    assert timings["work_s"] <= meter["seconds"] + 0.01
    # keep: 3 durable checkpoints, the newest being the final epoch.  Epochs here take
    # ~15 ms, faster than a checkpoint upload, so the uploader coalesces to the newest.
    steps = _durable_steps(out / "checkpoints")
    assert 1 <= len(steps) <= 3 and steps[-1] == 30
    final = load_state(out / "checkpoints" / "step-30" / STATE_FILE)
    assert final["epoch"] == 30
    assert all(torch.equal(final["model"][k], v) for k, v in torch.load(out / "model.pt", weights_only=True).items())

    # the returned model loads safely and reaches the accuracy on the held-out rows
    weights = torch.load(out / "model.pt", weights_only=True)
    model = build_model(64)
    model.load_state_dict(weights)
    x, y = load_digits_csv(DIGITS)
    _, test_idx = split(len(y), 0.2, 0)
    accuracy = evaluate(model, x[test_idx], y[test_idx])["accuracy"]
    assert accuracy >= 0.95
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert metrics["heldout_rows"] == 359 and metrics["train_rows"] == 1438

    # scratch is cleared after a verified completed return: the next run starts fresh
    assert list((scratch / spec.name / "checkpoints").glob("step-*")) == []


@pytest.mark.slow
def test_cli_short_limit_returns_partial_with_last_checkpoint(prefect_api, scratch, tmp_path, e31):
    out = tmp_path / "out"
    result = e31(
        "run", str(EXAMPLE), "--set", f"output.url={out}", "--set", "request.limit=9s",
        "--set", "request.duration=5s", "--set", "request.grace=2s", "--set", "work.params.epoch_sleep=0.4",
        env={"E31_SCRATCH": str(scratch)},
    )
    assert result.returncode == 3, result.stderr
    manifest = json.loads((out / "partial" / "manifest.json").read_text())
    assert manifest["status"] == "partial" and manifest["reason"] == "time_limit"
    steps = _durable_steps(out / "checkpoints")
    assert steps and manifest["step"] == steps[-1] and 1 <= manifest["step"] < 30
    assert manifest["checkpoint"] == str(out / "checkpoints" / f"step-{steps[-1]}")
    state = load_state(out / "checkpoints" / f"step-{steps[-1]}" / STATE_FILE)
    assert state["epoch"] == manifest["step"]
    assert set(state) == {"model", "optimizer", "scheduler", "rng_cpu", "epoch"}
    assert f"partial (time_limit): digits-nightly-retrain -> {out}/partial/" in result.stdout
    assert "Traceback" not in result.stderr
    # the declared files were not produced, and nothing pretends they were
    assert not (out / "model.pt").exists() and not (out / "partial" / "model.pt").exists()
    assert not (out / "manifest.json").exists()  # no complete output yet


def _command_spec(tmp_path: Path, code: str, name: str = "cmd-job") -> dict:
    return {
        "name": name,
        "work": {"kind": "processing", "command": [sys.executable, "-c", code]},
        "request": {"limit": "2m", "grace": "2s"},
        "output": {"kind": "files", "url": str(tmp_path / "out"), "files": ["result.txt"]},
    }


def test_command_work_completes_via_environment(prefect_api, scratch, tmp_path):
    (tmp_path / "in.txt").write_text("42\n")
    spec_dict = _command_spec(
        tmp_path,
        "import os, pathlib; v = pathlib.Path(os.environ['E31_DATA_NUMBERS']).read_text();"
        "pathlib.Path(os.environ['E31_OUTPUT_DIR'], 'result.txt').write_text(str(int(v) * 2) + ' ' + os.environ['OMP_NUM_THREADS'])",
    )
    spec_dict["data"] = [{"name": "numbers", "url": str(tmp_path / "in.txt")}]
    manifest = run_job(parse_spec(spec_dict))
    assert manifest["status"] == "completed"
    assert (tmp_path / "out" / "result.txt").read_text() == "84 1"
    assert manifest["files"] == [{"path": "result.txt", "bytes": 4, "sha256": hashlib.sha256(b"84 1").hexdigest()}]
    assert manifest["step"] is None and manifest["checkpoint"] is None


def test_failing_work_fails_with_exit_code_and_stderr(prefect_api, scratch, tmp_path):
    spec = parse_spec(_command_spec(tmp_path, "import sys; sys.stderr.write('boom: bad row 17\\n'); sys.exit(7)", "failing"))
    with pytest.raises(JobFailedError) as err:
        run_job(spec)
    manifest = err.value.manifest
    assert manifest["status"] == "failed" and manifest["reason"] == "error" and manifest["exit_code"] == 7
    assert manifest["message"] == "work exited with code 7"
    assert manifest["stderr_tail"] == "boom: bad row 17"
    assert "boom: bad row 17" in str(err.value)
    assert json.loads((tmp_path / "out" / "partial" / "manifest.json").read_text())["status"] == "failed"


def test_work_missing_declared_file_fails(prefect_api, scratch, tmp_path):
    spec = parse_spec(_command_spec(tmp_path, "pass", "lazy"))
    with pytest.raises(JobFailedError) as err:
        run_job(spec)
    assert err.value.manifest["message"] == "work finished without writing the declared output files: result.txt"


def test_flow_run_shows_tasks_artifacts_and_tags_in_the_ui(prefect_api, scratch, tmp_path):
    from prefect import tags
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId

    from e31.flows.deploy import job_tags

    out = tmp_path / "out"
    spec = load_spec(EXAMPLE, overrides=[f"output.url={out}", "work.params.epochs=3", "work.params.epoch_sleep=1.2"])
    with tags(*job_tags(spec)):
        state = run_job(spec, return_state=True)
    manifest = state.result()
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(state.state_details.flow_run_id)
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])))
    assert flow_run.name == "digits-nightly-retrain"
    assert sorted(flow_run.tags) == ["cpus:1", "e31", "gpus:0", "kind:training"]
    names = sorted(t.name for t in task_runs)
    assert names[0].startswith("checkpoint-step-") and names[-3:] == ["return", "run", "stage-digits"]
    by_key = {a.key: a for a in artifacts}
    # the staging and the return took less than a progress report's interval: no progress artifacts of theirs
    assert set(by_key) == {"job-spec", "progress", "manifest", "output"}
    assert by_key["job-spec"].type == "markdown" and "**work**: training" in by_key["job-spec"].data
    assert "**request**: 0 gpu, 1 cpu, memory 2GiB, " in by_key["job-spec"].data  # as the spec wrote it, not bytes
    assert by_key["progress"].type == "progress" and by_key["progress"].data == 100.0
    assert by_key["output"].data == f"[{out}]({out.as_uri()})"  # Prefect keeps a link artifact as markdown
    table = by_key["manifest"]
    assert table.type == "table"
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    meter = manifest["meter"]
    assert rows == [{**f, "status": "completed", "reason": "finished", "step": 3, **meter,
                     "preemptions": 0, "lost_s": 0.0} for f in manifest["files"]]
