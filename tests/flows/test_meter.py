"""The meter bills the work's time, from its start to the release, and
never the child's start (the interpreter, E31, the entrypoint's imports):
a work that does not use torch does not load it (issue 34, item 2).
Real Prefect server, real child processes; no GPU is needed (the meter's
rule is the same for GPUs: ``gpus`` x the same seconds)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from e31.flows.job import run_job
from e31.specs import parse_spec

HERE = Path(__file__).resolve().parent

#: The work's own start to the meter's start: the child writes its start marker and calls the function.
START_BOUND_S = 0.1

COMMAND = """
import json, os, sys, time
started = time.time()
torch_loaded = "torch" in sys.modules
time.sleep(1.0)
with open(os.path.join(os.environ["E31_OUTPUT_DIR"], "result.json"), "w") as fh:
    json.dump({"torch_loaded": torch_loaded, "started": started, "ended": time.time()}, fh)
"""


def _job(tmp_path: Path, name: str, work: dict) -> tuple[dict, dict, Path]:
    out = tmp_path / name
    spec = parse_spec({
        "name": name, "work": {"kind": "processing", **work},
        "request": {"cpus": 1, "limit": "5m"},
        "output": {"kind": "results", "url": str(out), "files": ["result.json"]},
    })
    manifest = run_job(spec, code_dir=str(HERE))
    assert manifest["status"] == "completed", manifest
    return manifest, json.loads((out / "result.json").read_text()), out


def _bills_the_work_only(manifest: dict, result: dict, out: Path, start_bound_s: float) -> None:
    meter = manifest["meter"]
    released_by = (out / "manifest.json").stat().st_mtime  # the manifest is the release's last write
    # it starts at the work's start, not at the child's spawn (its ends are rounded to ms)
    assert -0.0005 <= result["started"] - meter["started_at"] <= start_bound_s
    # it stops at the release: after the work ended, by the time the manifest was written
    assert result["ended"] - 0.0005 <= meter["released_at"] <= released_by + 0.001
    assert meter["seconds"] == round(meter["released_at"] - meter["started_at"], 3)
    assert (meter["cpu_seconds"], meter["gpu_seconds"]) == (meter["seconds"], 0.0)  # cpus: 1, gpus: 0
    # the work's own time, plus only its release: never the child's start
    assert result["ended"] - result["started"] <= meter["seconds"] <= released_by - result["started"] + start_bound_s


def test_python_work_without_torch_is_billed_from_its_start(prefect_api, scratch, tmp_path):
    manifest, result, out = _job(tmp_path, "meter-python", {"entrypoint": "meterwork:work"})
    assert result["torch_loaded"] is False  # the child did not import torch for a work that does not use it
    _bills_the_work_only(manifest, result, out, START_BOUND_S)
    # the child's start, its module's 2 s import (meterwork.IMPORT_S) among it, was not billed
    assert manifest["timings"]["child_start_s"] + manifest["timings"].get("prestart_s", 0.0) >= 2.0


def test_command_is_billed_from_its_exec(prefect_api, scratch, tmp_path):
    manifest, result, out = _job(tmp_path, "meter-command", {"command": [sys.executable, "-c", COMMAND]})
    assert result["torch_loaded"] is False
    # a command's work starts when it is exec'd: its interpreter's start (~50 ms; 1 s allowed under load) is billed
    _bills_the_work_only(manifest, result, out, 1.0)
