"""A resumed run's output (issue 34, items 3 and 4), through ``e31 run``
twice on a real Prefect server with real child processes: the first run
is stopped by its time limit and returns a partial output holding the
file its work writes only when stopped (``partial.json``); the second
resumes from its checkpoint, says so, and returns a completed output
holding exactly what its own work wrote."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_resumed_run_returns_only_its_own_files_and_says_where_it_resumed(prefect_api, scratch, tmp_path, e31):
    shutil.copy(HERE / "resumework.py", tmp_path / "resumework.py")
    out = tmp_path / "out"
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({
        "spec_version": 1, "name": "resumed-output",
        "work": {"kind": "processing", "entrypoint": "resumework:work", "params": {"n": 30, "step_s": 0.2}},
        "request": {"cpus": 1, "duration": "1s", "limit": "12s", "grace": "10s"},  # warned at 2 s
        "output": {"kind": "results", "url": str(out), "files": ["result.json"],
                   "checkpoint": {"every_steps": 1, "keep": 2}},
    }))
    env = {"E31_SCRATCH": str(scratch)}

    first = e31("run", str(spec), env=env)
    assert first.returncode == 3, first.stdout + first.stderr  # partial
    partial = json.loads((out / "partial" / "manifest.json").read_text())
    assert (partial["status"], partial["reason"], partial["resumed_from_step"]) == ("partial", "time_limit", None)
    step = partial["step"]
    assert 1 <= step < 30
    assert [f["path"] for f in partial["files"]] == ["partial.json"]
    assert "resumed from step" not in first.stdout + first.stderr

    second = e31("run", str(spec), "--set", "request.limit=3m", env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    said = f"resumed from step {step} ({out / 'checkpoints' / f'step-{step}'})"
    assert said in second.stdout.splitlines()  # printed as the work starts, whatever the log level
    assert [line for line in (second.stdout + second.stderr).splitlines() if "resumed from" in line] == [said]
    assert second.stdout.index(said) < second.stdout.index(f"completed (finished): resumed-output -> {out}")
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["status"], manifest["resumed_from_step"]) == ("completed", step)
    assert json.loads((out / "result.json").read_text()) == {"step": 30, "resumed_from": step}
    # the completed output holds exactly what the completing run's work wrote; partial/ is gone
    assert [f["path"] for f in manifest["files"]] == ["result.json"]
    assert {p for p in _files(out) if not p.startswith("checkpoints/")} == {"manifest.json", "result.json"}
