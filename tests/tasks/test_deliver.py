"""The return step: files verified, manifest last, completed never downgraded."""

from __future__ import annotations

import hashlib
import json
import time

from e31.tasks.deliver import ReturnTarget, deliver
from e31.tasks.outcome import RunOutcome


def _target(tmp_path, run_id="run-1") -> ReturnTarget:
    return ReturnTarget(job="j", run_id=run_id, output_dir=str(tmp_path / "scratch-out"), output_url=str(tmp_path / "dest"),
                        declared=["a.txt"], gpus=0, cpus=2, spec_sha256="s")


def test_deliver_copies_nested_files_and_writes_manifest_last(tmp_path):
    src = tmp_path / "scratch-out"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"alpha")
    (src / "sub" / "b.bin").write_bytes(b"\x00\x01")
    before = time.time()
    manifest = deliver(_target(tmp_path), RunOutcome(reason="finished", exit_code=0, run_s=2.0,
                                                     work_started_at=before - 2.0))
    assert manifest["status"] == "completed"
    assert manifest["files"] == [
        {"path": "a.txt", "bytes": 5, "sha256": hashlib.sha256(b"alpha").hexdigest()},
        {"path": "sub/b.bin", "bytes": 2, "sha256": hashlib.sha256(b"\x00\x01").hexdigest()},
    ]
    meter = manifest["meter"]  # the work's start to the release (the return, within this call)
    assert meter["started_at"] == round(before - 2.0, 3) and before <= meter["released_at"] <= time.time()
    assert meter["seconds"] == round(meter["released_at"] - meter["started_at"], 3) >= 2.0
    assert (meter["gpu_seconds"], meter["cpu_seconds"]) == (0.0, round(2 * meter["seconds"], 3))
    assert (tmp_path / "dest" / "sub" / "b.bin").read_bytes() == b"\x00\x01"
    assert json.loads((tmp_path / "dest" / "manifest.json").read_text()) == manifest
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == ["a.txt", "manifest.json", "sub"]  # no temp files


def test_completed_run_is_never_downgraded(tmp_path):
    (tmp_path / "scratch-out").mkdir()
    (tmp_path / "scratch-out" / "a.txt").write_text("x")
    first = deliver(_target(tmp_path), RunOutcome(reason="finished", exit_code=0, run_s=1.0))
    late = deliver(_target(tmp_path), RunOutcome(reason="signal", exit_code=0, run_s=1.0))  # a signal after completion
    assert late == first and late["status"] == "completed"
    assert json.loads((tmp_path / "dest" / "manifest.json").read_text())["status"] == "completed"
    # a new run of the same job does replace it
    newer = deliver(_target(tmp_path, run_id="run-2"), RunOutcome(reason="time_limit", exit_code=0, run_s=1.0))
    assert (newer["run_id"], newer["status"]) == ("run-2", "partial")


def test_a_later_attempt_of_the_same_run_replaces_its_completed_output_whole(tmp_path):
    """A run queued again after its node was lost runs under the same flow
    run id: each attempt's manifest names it, and a completed output is
    kept against the same attempt only (guards against the later attempt's
    return being skipped and its output thrown away)."""
    import dataclasses

    out = tmp_path / "scratch-out"
    out.mkdir()
    (out / "a.txt").write_text("from n1")
    (out / "old.txt").write_text("only n1 wrote this")
    n1 = dataclasses.replace(_target(tmp_path), attempt="n1-100-aaaaaaaa")
    first = deliver(n1, RunOutcome(reason="finished", exit_code=0, run_s=1.0))
    assert first["attempt"] == "n1-100-aaaaaaaa"
    (out / "old.txt").unlink()
    (out / "a.txt").write_text("from n2")
    assert deliver(n1, RunOutcome(reason="finished", exit_code=0, run_s=1.0)) == first  # the same attempt: kept
    n2 = dataclasses.replace(_target(tmp_path), attempt="n2-200-bbbbbbbb")
    second = deliver(n2, RunOutcome(reason="finished", exit_code=0, run_s=1.0))
    assert (second["attempt"], second["status"]) == ("n2-200-bbbbbbbb", "completed")
    assert [f["path"] for f in second["files"]] == ["a.txt"]
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == ["a.txt", "manifest.json"]  # n1's extra gone
    assert (tmp_path / "dest" / "a.txt").read_text() == "from n2"
    assert json.loads((tmp_path / "dest" / "manifest.json").read_text()) == second


def test_signals_are_deferred_while_returning(capsys):
    import os
    import signal

    from e31.tasks.supervisor.process import signals_deferred

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # (SIG_IGN under nohup)
    with signals_deferred("returning first"):
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt here
        os.kill(os.getpid(), signal.SIGTERM)
    assert capsys.readouterr().err == "returning first\n"
    assert {sig: signal.getsignal(sig) for sig in before} == before  # the handlers from before come back
