"""A job's run guards: one run of a job at a time, a
command that cannot start, a destination that cannot be written, stale
checkpoints removed and nothing else, command checkpoints and cwd."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from e31.flows.job import JobFailedError, run_job
from e31.flows.resume import JobBusyError
from e31.specs import parse_spec
from e31.tasks.deliver import DestinationError


def _cmd(tmp_path: Path, name: str, command: list[str], files=("result.txt",), **output) -> dict:
    return {
        "name": name,
        "work": {"kind": "processing", "command": command},
        "request": {"limit": "2m", "grace": "2s"},
        "output": {"kind": "files", "url": str(tmp_path / "out"), "files": list(files), **output},
    }


def test_a_command_that_cannot_start_fails_cleanly(prefect_api, scratch, tmp_path):
    with pytest.raises(JobFailedError) as err:
        run_job(parse_spec(_cmd(tmp_path, "no-program", ["nosuchprog-e31", "a"])))
    manifest = err.value.manifest
    assert (manifest["status"], manifest["exit_code"]) == ("failed", 127)
    assert manifest["message"] == "cannot start work.command ['nosuchprog-e31', 'a']: No such file or directory"


def test_unwritable_destination_is_refused_before_anything_runs(prefect_api, scratch, tmp_path):
    (tmp_path / "afile").write_text("x")
    spec = _cmd(tmp_path, "bad-dest", [sys.executable, "-c", "open('ran', 'w')"])
    spec["output"]["url"] = str(tmp_path / "afile")
    with pytest.raises(DestinationError) as err:
        run_job(parse_spec(spec), code_dir=str(tmp_path))
    assert str(err.value) == (f"output.url: {tmp_path}/afile: a file is in the way; the destination must be a folder: "
                              "give a folder of the job's own")
    assert not (tmp_path / "ran").exists()
    spec["output"]["url"] = "nosuchproto://x/"
    with pytest.raises(DestinationError, match=r"^output.url: nosuchproto://x/: Protocol not known: nosuchproto$"):
        run_job(parse_spec(spec))


def test_second_run_of_the_same_job_is_refused_while_the_first_holds_it(prefect_api, scratch, tmp_path):
    from e31.flows.compile import compile_plan
    from e31.flows.resume import end_attempt, prepare_scratch

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    spec = parse_spec(_cmd(tmp_path, "guard-held", [sys.executable, "-c", "pass"]))
    plan = compile_plan(spec)
    prepare_scratch(plan)  # as a first run would, in this process
    try:
        with pytest.raises(JobBusyError) as err:
            run_job(spec)
        assert str(err.value).startswith("job guard-held is already running on this machine (pid ")
    finally:
        end_attempt(plan)
    assert not (tmp_path / "out" / "manifest.json").exists()
    # (a name no other test uses: flow runs are named after their job on the session's one server)
    # the refused run is no failure in the job's history: Cancelled, named Refused, with the reason
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["guard-held"])))
    assert [(r.state.type.value, r.state.name) for r in runs] == [("CANCELLED", "Refused")]
    assert runs[0].state.message.startswith("refused: job guard-held is already running on this machine (pid ")


def test_the_cli_refuses_a_second_run_before_a_flow_run_exists(e31, prefect_api, scratch, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from e31.flows.compile import compile_plan
    from e31.flows.resume import end_attempt, prepare_scratch

    (tmp_path / "job.yaml").write_text(yaml.safe_dump(_cmd(tmp_path, "busy-cli", [sys.executable, "-c", "pass"])))
    plan = compile_plan(parse_spec(_cmd(tmp_path, "busy-cli", [sys.executable, "-c", "pass"])))
    prepare_scratch(plan)
    try:
        result = e31("run", str(tmp_path / "job.yaml"), env={"E31_SCRATCH": str(scratch)})
    finally:
        end_attempt(plan)
    assert result.returncode == 1
    assert result.stderr.startswith(f"e31: job busy-cli is already running on this machine (pid {os.getpid()}, ")
    with get_client(sync_client=True) as client:
        assert client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["busy-cli"]))) == []


def test_fresh_start_removes_only_stale_step_folders(prefect_api, scratch, tmp_path):
    shared = tmp_path / "shared"
    (shared / "step-3").mkdir(parents=True)
    (shared / "step-3" / "COMMITTED").write_text("")
    (shared / "important.txt").write_text("keep me")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").write_text(json.dumps({"status": "completed", "run_id": "older"}))
    code = "import os, pathlib; pathlib.Path(os.environ['E31_OUTPUT_DIR'], 'result.txt').write_text('ok')"
    spec = _cmd(tmp_path, "shared-ck", [sys.executable, "-c", code], checkpoint={"url": str(shared)})
    assert run_job(parse_spec(spec))["status"] == "completed"
    assert sorted(p.name for p in shared.iterdir()) == ["important.txt"]
    assert (shared / "important.txt").read_text() == "keep me"


def test_a_run_that_fails_staging_keeps_the_earlier_runs_checkpoints(prefect_api, scratch, tmp_path):
    """A rerun whose input is missing must not delete the durable
    checkpoints of the last completed run before it fails.  They make way
    only once a fresh run has staged its inputs; step folders without
    E31's marker are never removed."""
    durable = tmp_path / "out" / "checkpoints"
    for step, marker in ((3, True), (1, False)):
        (durable / f"step-{step}").mkdir(parents=True)
        (durable / f"step-{step}" / "state.pt").write_bytes(b"s%d" % step)
        if marker:
            (durable / f"step-{step}" / "COMMITTED").write_text(json.dumps(
                {"step": step, "files": {"state.pt": {"bytes": 2, "sha256": "0" * 64}}, "work_sha256": "other"}))
    (tmp_path / "out" / "manifest.json").write_text(json.dumps({"status": "completed", "run_id": "older"}))
    (tmp_path / "in.txt").write_text("input")
    code = "import os, pathlib; pathlib.Path(os.environ['E31_OUTPUT_DIR'], 'result.txt').write_text('ok')"
    spec = _cmd(tmp_path, "keeps-ck", [sys.executable, "-c", code])
    spec["data"] = [{"name": "inp", "url": str(tmp_path / "missing.txt")}]
    from e31.tasks.stage import StageError

    with pytest.raises(StageError):
        run_job(parse_spec(spec))
    assert sorted(p.name for p in durable.iterdir()) == ["step-1", "step-3"]
    assert (durable / "step-3" / "state.pt").read_bytes() == b"s3"
    assert json.loads((tmp_path / "out" / "partial" / "manifest.json").read_text())["status"] == "failed"
    # the earlier complete output's manifest is untouched: a failed run never writes at the top
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == {"status": "completed", "run_id": "older"}

    spec["data"] = [{"name": "inp", "url": str(tmp_path / "in.txt")}]
    assert run_job(parse_spec(spec))["status"] == "completed"
    assert sorted(p.name for p in durable.iterdir()) == ["step-1"]  # the committed one made way; not the other
    assert (durable / "step-1" / "state.pt").read_bytes() == b"s1"


def test_command_checkpoints_with_an_empty_marker_and_cwd_beside_the_spec(prefect_api, scratch, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, pathlib\n"
        "ck = pathlib.Path(os.environ['E31_CHECKPOINT_DIR'])\n"
        "resume = os.environ['E31_RESUME_DIR']\n"
        "for step in (1, 2):\n"
        "    d = ck / f'step-{step}'\n"
        "    d.mkdir(parents=True)\n"
        "    (d / 'weights.bin').write_bytes(bytes([step]) * 10)\n"
        "    (d / 'COMMITTED').write_text('')\n"
        "pathlib.Path(os.environ['E31_OUTPUT_DIR'], 'result.txt').write_text(os.getcwd() + '|' + resume)\n"
    )
    manifest = run_job(parse_spec(_cmd(tmp_path, "cmd-ck", [sys.executable, "job.py"])), code_dir=str(tmp_path))
    assert manifest["status"] == "completed" and manifest["step"] == 2
    assert (tmp_path / "out" / "result.txt").read_text() == f"{tmp_path}|"
    durable = tmp_path / "out" / "checkpoints" / "step-2"
    assert (durable / "weights.bin").read_bytes() == bytes([2]) * 10
    marker = json.loads((durable / "COMMITTED").read_text())
    assert marker["step"] == 2 and marker["files"]["weights.bin"]["bytes"] == 10


def test_expected_refusals_fail_the_flow_run_with_one_line_and_no_traceback(prefect_api, scratch, tmp_path,
                                                                            monkeypatch):
    """A request too large for the machine must not log two full tracebacks
    in the flow run's log (the UI).  The caller
    still gets the exception; the run fails with its one-line message."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from e31.flows.admission import AdmissionError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    spec = _cmd(tmp_path, "too-big", [sys.executable, "-c", "open('ran', 'w')"])
    spec["request"]["gpus"] = 8
    state = run_job(parse_spec(spec), return_state=True)
    with pytest.raises(AdmissionError) as err:
        state.result()
    assert str(err.value).startswith("request does not fit this machine (")
    assert (state.type.value, state.message) == ("FAILED", str(err.value))
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # logs reach the API in batches
    only_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
    deadline, text = time.monotonic() + 20, ""
    while str(err.value) not in text and time.monotonic() < deadline:
        time.sleep(0.5)
        with get_client(sync_client=True) as client:
            text = "\n".join(log.message for log in client.read_logs(log_filter=only_run))
    assert str(err.value) in text and "Traceback" not in text
    assert not (tmp_path / "ran").exists()


def test_an_input_whose_credential_is_missing_fails_with_a_manifest_saying_so(prefect_api, scratch, tmp_path,
                                                                               monkeypatch):
    """An input credential's environment variable missing on the worker
    must not leave the previous run's manifest at the destination as the
    only word; like a missing input, it writes a failed one, in partial/
    (the earlier complete output stays)."""
    from e31.tasks.storage.credentials import CredentialError

    monkeypatch.delenv("E31_TEST_UNSET_TOKEN", raising=False)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").write_text(json.dumps({"status": "completed", "run_id": "older"}))
    spec = _cmd(tmp_path, "no-token", [sys.executable, "-c", "open('ran', 'w')"])
    spec["data"] = [{"name": "table", "url": "https://127.0.0.1:9/table.csv",
                     "storage_options": {"headers": {"Authorization": {"env": "E31_TEST_UNSET_TOKEN"}}}}]
    with pytest.raises(CredentialError) as err:
        run_job(parse_spec(spec), code_dir=str(tmp_path))
    assert str(err.value).startswith("data[0].storage_options.headers.Authorization: the environment variable "
                                     "E31_TEST_UNSET_TOKEN is not set on this worker")
    manifest = json.loads((tmp_path / "out" / "partial" / "manifest.json").read_text())
    assert (manifest["status"], manifest["reason"], manifest["message"]) == ("failed", "error", str(err.value))
    assert manifest["run_id"] != "older" and manifest["files"] == []
    assert not (tmp_path / "ran").exists()
