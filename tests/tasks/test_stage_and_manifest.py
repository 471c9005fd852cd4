"""Staging (copy, verify, cache) and the manifest's verdict rules."""

from __future__ import annotations

import hashlib
import os

import pytest

from e31.specs import DataInput
from e31.tasks.manifest import Verdict, build_manifest, verdict
from e31.tasks.stage import StageError, stage_input


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_stage_copies_verifies_and_reuses(tmp_path):
    src = tmp_path / "src" / "table.csv"
    src.parent.mkdir()
    src.write_bytes(b"a,b\n1,2\n")
    item = DataInput(name="table", url=str(src), sha256=_sha(b"a,b\n1,2\n"))
    first = stage_input(item, tmp_path / "data")
    assert first.copied is True and first.bytes == 8
    assert first.path == str(tmp_path / "data" / "table" / "table.csv")
    assert open(first.path, "rb").read() == b"a,b\n1,2\n"
    second = stage_input(item, tmp_path / "data")
    assert second.copied is False and second.path == first.path
    # a changed source (new size and mtime) is copied again
    src.write_bytes(b"a,b\n1,2\n3,4\n")
    third = stage_input(DataInput(name="table", url=str(src)), tmp_path / "data")
    assert third.copied is True and open(third.path, "rb").read() == b"a,b\n1,2\n3,4\n"


def test_stage_folder_keeps_tree_and_does_not_nest(tmp_path):
    src = tmp_path / "frames"
    (src / "a").mkdir(parents=True)
    (src / "a" / "1.txt").write_text("one")
    (src / "2.txt").write_text("two")
    for url in (str(src), str(src) + "/"):
        staged = stage_input(DataInput(name="frames", url=url), tmp_path / "data")
        root = tmp_path / "data" / "frames"
        assert staged.path == str(root)
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        assert files == ["2.txt", "a/1.txt"]


def test_stage_sha256_mismatch_fails_and_removes_copy(tmp_path):
    src = tmp_path / "x.bin"
    src.write_bytes(b"hello")
    wrong = "0" * 64
    with pytest.raises(StageError) as err:
        stage_input(DataInput(name="x", url=str(src), sha256=wrong), tmp_path / "data")
    assert str(err.value) == (
        f"data 'x': sha256 mismatch: declared {wrong}, staged file has {_sha(b'hello')}. "
        "Fix: update data[].sha256 if the input changed on purpose."
    )
    assert not (tmp_path / "data" / "x").exists()


def test_stage_missing_input_names_it(tmp_path):
    missing = tmp_path / "nope.csv"
    with pytest.raises(StageError) as err:
        stage_input(DataInput(name="nope", url=str(missing)), tmp_path / "data")
    assert str(err.value) == f"data 'nope': {missing}: not found"


def test_stage_error_masks_credentials(tmp_path):
    url = "memory://user:hunter2@bucket/missing.csv"  # specs refuse it; staging masks it anyway
    with pytest.raises(StageError) as err:
        stage_input(DataInput.model_construct(name="m", url=url, sha256=None), tmp_path / "data")
    assert "hunter2" not in str(err.value)


@pytest.mark.parametrize(
    "reason, code, present, expected",
    [
        ("finished", 0, {"model.pt", "metrics.json"}, Verdict("completed", "finished", "")),
        ("finished", 0, {"model.pt"}, Verdict("failed", "error", "work finished without writing the declared output files: metrics.json")),
        ("error", 7, set(), Verdict("failed", "error", "work exited with code 7")),
        ("time_limit", -9, set(), Verdict("partial", "time_limit", "")),
        ("deadline", 0, {"model.pt", "metrics.json"}, Verdict("partial", "deadline", "")),
        ("cancelled", 0, set(), Verdict("partial", "cancelled", "")),
        ("signal", 0, set(), Verdict("partial", "signal", "")),
    ],
)
def test_verdict(reason, code, present, expected):
    assert verdict(reason, code, ["model.pt", "metrics.json"], present) == expected


def test_manifest_meter_bills_work_start_to_release():
    m = build_manifest(
        job="j", run_id="r", verdict=Verdict("completed", "finished"), exit_code=0, step=3,
        files=[{"path": "a", "bytes": 1, "sha256": "x"}], checkpoint="/c/step-3",
        timings={"staging_s": 0.5, "run_s": 10.0, "return_s": 0.25}, gpus=2, cpus=4,
        spec_sha256="s", finished_at="t", work_started_at=1000.25, released_at=1010.5,
    )
    # from the work's start to the release; staging and the child's start are not billed
    assert m["meter"] == {"started_at": 1000.25, "released_at": 1010.5, "seconds": 10.25, "gpu_seconds": 20.5,
                          "cpu_seconds": 41.0}
    assert m["resumed_from_step"] is None
    assert m["staged_before_allocation"] is None
    assert m["timings"] == {"staging_s": 0.5, "run_s": 10.0, "return_s": 0.25}
    assert list(m) == ["job", "run_id", "attempt", "tenant", "status", "reason", "message", "exit_code", "step", "resumed_from_step", "preemptions", "lost_s", "folder", "files", "stale",
                       "checkpoint", "timings", "meter", "staged_before_allocation", "peak_memory_bytes", "spec_sha256", "finished_at",
                       "stop_requested_at", "logs"]
    assert (m["folder"], m["stale"]) == (".", [])
    # no work started (stopped while staging, refused): nothing billed
    none = build_manifest(
        job="j", run_id="r", verdict=Verdict("partial", "cancelled"), exit_code=None, step=None, files=[],
        checkpoint=None, timings={"staging_s": 3.0, "run_s": 0.0}, gpus=2, cpus=4, spec_sha256="s", finished_at="t",
        released_at=1010.5, resumed_from_step=7)
    assert none["meter"] == {"started_at": None, "released_at": None, "seconds": 0.0, "gpu_seconds": 0.0,
                             "cpu_seconds": 0.0}
    assert none["resumed_from_step"] == 7
    assert m["logs"] == {"stdout_tail": "", "stderr_tail": "", "lines_not_forwarded": 0}


def test_staged_copy_changed_in_place_is_staged_again(tmp_path):
    src = tmp_path / "in.csv"
    src.write_bytes(b"1,2,3\n")
    item = DataInput(name="t", url=str(src))
    first = stage_input(item, tmp_path / "data")
    with open(first.path, "r+b") as fh:  # same size, other bytes
        fh.write(b"9")
    os.utime(first.path, ns=(1, 1))
    again = stage_input(item, tmp_path / "data")
    assert again.copied is True and open(again.path, "rb").read() == b"1,2,3\n"
