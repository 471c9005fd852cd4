"""Resume is exact: a training run killed after its step-N checkpoint and
retried ends bitwise equal to an uninterrupted run with the same seed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from e31.flows.job import run_job
from e31.specs import parse_spec

HERE = Path(__file__).resolve().parent
DIGITS = HERE.parents[1] / "specs" / "examples" / "data" / "digits.csv.gz"


def _run(tmp_path: Path, name: str, **params) -> tuple[dict, Path]:
    out = tmp_path / name
    spec = parse_spec({
        "name": name,
        "work": {"kind": "training", "entrypoint": "resumable:train", "params": params},
        "data": [{"name": "digits", "url": str(DIGITS)}],
        "request": {"limit": "5m", "retries": 1},
        "output": {"kind": "model", "url": str(out), "files": ["model.pt", "steps.jsonl"]},
    })
    return run_job(spec, code_dir=str(HERE)), out


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def test_killed_and_resumed_training_equals_uninterrupted(prefect_api, scratch, tmp_path):
    whole, whole_out = _run(tmp_path, "uninterrupted")
    resumed, resumed_out = _run(tmp_path, "killed-at-35", kill_after_step=35)
    assert whole["status"] == resumed["status"] == "completed"
    assert (whole_out / "resumed_from.txt").read_text() == "0"
    assert (resumed_out / "resumed_from.txt").read_text() == "35"  # the retry started at the step-35 checkpoint

    a = torch.load(whole_out / "model.pt", weights_only=True)
    b = torch.load(resumed_out / "model.pt", weights_only=True)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)  # bitwise equal

    log_a, log_b = _log(whole_out), _log(resumed_out)
    assert [r["step"] for r in log_b] == list(range(1, 88))  # 3 epochs x 29 batches, none twice
    assert [r["lr"] for r in log_a] == [r["lr"] for r in log_b]  # the same learning rate at every step
    assert log_a == log_b  # the same batches in the same order
    for epoch in range(3):
        seen = sorted(i for r in log_b if r["epoch"] == epoch for i in r["ids"])
        assert seen == list(range(1797))  # each sample exactly once per epoch
