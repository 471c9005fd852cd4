"""docs/manifest.md is generated from the typed manifest (tasks/manifest_model.py), and the
typed manifest reads back what E31 writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from e31.tasks.destination import Destination, known_files, load_manifest
from e31.tasks.manifest import Verdict, build_manifest
from e31.tasks.manifest_doc import COMMAND, render
from e31.tasks.manifest_model import REASONS, STATUSES, Manifest, ReturningNote, parse_manifest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "manifest.md"


def test_docs_manifest_md_is_generated_from_the_model():
    assert PAGE.read_text() == render(), f"docs/manifest.md differs from the model; regenerate it: {COMMAND}"


def test_every_status_and_reason_is_documented():
    text = PAGE.read_text()
    for value in (*STATUSES, "returning", *REASONS):
        assert f"| `{value}` |" in text


def _manifest(**over):
    kw = dict(job="j", run_id="r", verdict=Verdict("failed", "error", "boom"), exit_code=3, step=None,
              files=[{"path": "a", "bytes": 1, "sha256": "x"}], checkpoint=None,
              timings={"staging_s": 0.5, "run_s": 2, "return_s": 0.25}, gpus=1, cpus=2, spec_sha256="s",
              finished_at="t", stderr_tail="oops\n", work_started_at=1000, released_at=1002.5)
    return build_manifest(**{**kw, **over})


def test_a_written_manifest_reads_back_typed_and_writes_the_same_bytes():
    written = _manifest()
    typed = parse_manifest(json.loads(json.dumps(written)))
    assert isinstance(typed, Manifest)
    assert (typed.status, typed.reason, typed.exit_code, typed.stderr_tail) == ("failed", "error", 3, "oops\n")
    assert (typed.meter.started_at, typed.meter.seconds, typed.files[0].path) == (1000, 2.5, "a")
    assert json.dumps(typed.to_json_dict(), indent=2) == json.dumps(written, indent=2)  # 1000 stays 1000
    assert "stderr_tail" not in _manifest(verdict=Verdict("partial", "signal"))  # absent, not null


def test_a_status_or_reason_outside_the_literals_is_refused_when_written():
    with pytest.raises(ValueError, match="reason"):
        _manifest(verdict=Verdict("partial", "stopped"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="status"):
        _manifest(verdict=Verdict("done", "finished"))  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ['{"status": "completed", "run_id": "older"}', '{"status": "done"}',
                                  '[1, 2]', '{"job": "j", "status": "comp', ""])
def test_a_manifest_that_is_not_valid_reads_as_none(tmp_path, text):
    (tmp_path / "manifest.json").write_text(text)
    assert load_manifest(str(tmp_path)) is None
    assert known_files(load_manifest(str(tmp_path))) == set()


def test_the_returning_note_is_typed_and_lists_the_previous_files(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(_manifest()))
    Destination(str(tmp_path)).withdraw("j", "r2", ["b", "a"])
    note = load_manifest(str(tmp_path))
    assert isinstance(note, ReturningNote)
    assert (note.run_id, note.writing, note.written_before) == ("r2", ["a", "b"], ["a"])
    assert list(json.loads((tmp_path / "manifest.json").read_text())) == [
        "job", "run_id", "status", "message", "writing", "written_before", "started_at"]
    assert known_files(note) == {"a", "b"}


def test_the_head_reads_what_a_state_is_worded_from_and_nothing_of_a_hand_edited_file():
    from e31.tasks.manifest_model import ManifestHead

    head = ManifestHead.of({"status": "partial", "reason": "cancelled", "files": [{}, {}], "folder": "partial"})
    assert (head.status, head.reason, len(head.files), head.folder, head.run_id) == (
        "partial", "cancelled", 2, "partial", None)
    assert ManifestHead.of(_manifest()).status == "failed"
    assert ManifestHead.of({"status": "done", "run_id": "r"}) == ManifestHead()  # not a status: nothing is taken


#: manifest.json as the writer before the typed model made it for these values (byte for byte).
GOLDEN = """{
  "job": "nightly",
  "run_id": "0b1c",
  "attempt": "n1-100-aaaaaaaa",
  "tenant": null,
  "status": "failed",
  "reason": "error",
  "message": "work exited with code 3",
  "exit_code": 3,
  "step": 12,
  "resumed_from_step": null,
  "preemptions": 0,
  "lost_s": 0.0,
  "folder": "partial",
  "files": [
    {
      "path": "model.pt",
      "bytes": 1048576,
      "sha256": "abababababababababababababababababababababababababababababababab"
    }
  ],
  "stale": [
    "notes.txt"
  ],
  "checkpoint": "s3://bucket/ck/step-12",
  "timings": {
    "prefetch_s": 0.0,
    "staging_s": 1.235,
    "run_s": 60.0,
    "work_s": 58.5,
    "return_s": 0.0
  },
  "meter": {
    "started_at": 1764871140.123,
    "released_at": 1764871200.5,
    "seconds": 60.377,
    "gpu_seconds": 120.754,
    "cpu_seconds": 483.016
  },
  "staged_before_allocation": false,
  "peak_memory_bytes": 123456789,
  "spec_sha256": "cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd",
  "finished_at": "2026-12-04T18:00:00+00:00",
  "stop_requested_at": null,
  "logs": {
    "stdout_tail": "step 12\\n",
    "stderr_tail": "Traceback\\nValueError: x\\n",
    "lines_not_forwarded": 0
  },
  "stderr_tail": "Traceback\\nValueError: x\\n"
}
"""


def test_the_typed_writer_writes_the_bytes_the_untyped_one_did():
    written = build_manifest(
        job="nightly", run_id="0b1c", verdict=Verdict("failed", "error", "work exited with code 3"), exit_code=3,
        step=12, files=[{"path": "model.pt", "bytes": 1048576, "sha256": "ab" * 32}],
        checkpoint="s3://bucket/ck/step-12",
        timings={"prefetch_s": 0.0, "staging_s": 1.23456, "run_s": 60, "work_s": 58.5, "return_s": 0.0004},
        gpus=2, cpus=8, spec_sha256="cd" * 32, finished_at="2026-12-04T18:00:00+00:00",
        stderr_tail="Traceback\nValueError: x\n", stop_requested_at=None, stdout_tail="step 12\n",
        output_lines_dropped=0, folder="partial", stale=["notes.txt"], peak_memory=123456789,
        staged_before_allocation=False, attempt="n1-100-aaaaaaaa", work_started_at=1764871140.1234,
        released_at=1764871200.5, resumed_from_step=None)
    assert json.dumps(written, indent=2) + "\n" == GOLDEN


def test_a_manifest_an_earlier_e31_wrote_still_reads_as_its_verdict():
    """The first manifests had no folder, attempt, stale, logs or meter times:
    such a completed output is still completed (its files are not stale),
    and a partial one is read from partial/."""
    earlier = {"job": "j", "run_id": "r1", "status": "completed", "reason": "finished", "message": "", "exit_code": 0,
               "step": 4, "files": [{"path": "a.txt", "bytes": 3, "sha256": "ab" * 32}], "checkpoint": None,
               "timings": {"run_s": 1.5}, "meter": {"gpu_seconds": 0.0, "cpu_seconds": 1.5},
               "finished_at": "2026-01-01T00:00:00+00:00"}
    typed = parse_manifest(earlier)
    assert isinstance(typed, Manifest)
    assert (typed.status, typed.folder, typed.step, [f.path for f in typed.files]) == ("completed", ".", 4, ["a.txt"])
    assert (typed.attempt, typed.stale, typed.meter.cpu_seconds, typed.meter.seconds) == (None, [], 1.5, 0.0)
    partial = parse_manifest({**earlier, "status": "partial", "reason": "signal", "files": []})
    assert (partial.status, partial.folder) == ("partial", "partial")
    assert parse_manifest({k: v for k, v in earlier.items() if k != "run_id"}) is None  # run_id was always written
