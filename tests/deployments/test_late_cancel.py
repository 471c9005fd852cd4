"""A cancel that reaches a queued run after its work has ended changes
nothing: the output comes back whole, the run ends in the state its manifest
says, and ``e31 cancel`` says it came too late.  Real ``prefect server
start``, ``e31 scheduler`` and ``e31 worker`` processes; the run's flow
process stops itself with a real SIGSTOP at the moment under test (the
manifest just written; the return under way: :mod:`tests.hold`) and is let
go with SIGCONT, so the cancel lands in that moment on any machine, however
loaded."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests import hold
from tests.deployments.test_queue import queue, wait_for

#: The work: a few files, and the pid of the process that started it (the run's flow process).
WORK = textwrap.dedent("""
    import json, os, pathlib
    out = pathlib.Path(os.environ["E31_OUTPUT_DIR"])
    for i in range(int(os.environ.get("FILES", "3"))):
        (out / f"part-{i}.bin").write_bytes(os.urandom(4096))
    (out / "record.json").write_text(json.dumps({"flow_pid": os.getppid()}))
""")


def _job(q, name: str) -> Path:
    (q.root / "late.py").write_text(WORK)
    spec = q.root / f"{name}.yaml"
    spec.write_text(json.dumps({
        "name": name, "work": {"kind": "simulation", "command": [sys.executable, "late.py"]},
        "request": {"cpus": 1, "duration": "20s", "limit": "5m", "grace": "2s"},
        "output": {"kind": "results", "url": str(q.root / "out" / name), "files": ["record.json"]}}))
    return spec


def _manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def _held_worker(q, status: str) -> None:
    """Start n1's worker; its flow processes stop themselves after their first manifest of ``status``."""
    q.start("worker-n1", "worker", "--pool", str(q.pool), "--node", "n1",
            env={"E31_NODE_GPUS": "0", "E31_SCRATCH": str(q.root / "scratch-n1"),
                 **hold.env(status, q.root / "held")})


def _flow_pid(scratch: Path, out: Path):
    """The pid the work recorded (in the job's scratch output, or once
    returned at the destination), or None."""
    def read() -> int | None:
        for path in (scratch / out.name / "output" / "record.json", out / "record.json"):
            try:
                return json.loads(path.read_text())["flow_pid"]
            except (OSError, ValueError, KeyError):
                continue
        return None
    return read


def _logged(run_id: str, words: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200)
    return any(words in log.message for log in logs)


def _state(run_id: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id).state


def test_e31_cancel_after_the_manifest_is_written_is_too_late_and_the_run_ends_completed(prefect_api, tmp_path):
    """The cancel comes once the output's manifest is written, before the
    run's final state: ``e31 cancel`` says it came too late (exit 1) and
    writes nothing; the run ends ``Completed`` and the manifest is the one
    written before the cancel, byte for byte."""
    name = "late-manifest"
    with queue(tmp_path, {"n1": 0}) as q:
        q.scheduler()
        _held_worker(q, "completed")
        run_id = q.submit(_job(q, name)).split("flow run ")[1].split()[0]
        out = q.root / "out" / name
        pid = hold.wait_stopped(_flow_pid(q.root / "scratch-n1", out))
        try:
            held = _state(run_id)
            assert held.type.value == "RUNNING", f"the run ended before it was held: {held}"
            digest = hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest()
            said = subprocess.run([q.exe, "cancel", name, "--pool", str(q.pool)], capture_output=True, text=True,
                                  cwd=q.root)
            during = _state(run_id)
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: _state(run_id).is_final(), timeout=120, what="the run's end")
        final = _state(run_id)
    assert (said.returncode, said.stdout) == (1, ""), said
    assert re.fullmatch(rf"e31: cancel: run {name} \({run_id}\) had already finished its work \(at \d\d:\d\d:\d\d UTC\): "
                        r"nothing to cancel; its output is returned whole and the run ends as its manifest says\n",
                        said.stderr), said.stderr
    assert during.type.value == "RUNNING"  # nothing was written
    assert (final.type.value, final.name) == ("COMPLETED", "Completed")
    assert hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest() == digest
    manifest = _manifest(out)
    assert (manifest["status"], manifest["run_id"]) == ("completed", run_id)
    assert sorted(f["path"] for f in manifest["files"]) == ["part-0.bin", "part-1.bin", "part-2.bin", "record.json"]


def test_a_cancel_from_the_api_during_the_return_ends_completed_with_the_whole_output(prefect_api, tmp_path):
    """A cancel through the API (as the Prefect UI's, or ``prefect flow-run
    cancel``) while the return writes the output: the return goes to its
    end (no signal, no kill from the worker), the manifest says
    ``completed`` with every file, and the run ends ``Completed``, never
    ``Cancelled``; ``e31 cancel`` then says the run had ended."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    name = "late-return"
    with queue(tmp_path, {"n1": 0}) as q:
        q.scheduler()
        _held_worker(q, "returning")
        run_id = q.submit(_job(q, name)).split("flow run ")[1].split()[0]
        out = q.root / "out" / name
        pid = hold.wait_stopped(_flow_pid(q.root / "scratch-n1", out))
        assert _manifest(out)["status"] == "returning"
        try:
            with get_client(sync_client=True) as client:
                result = client.set_flow_run_state(run_id, Cancelling(message="cancel from the UI"))
            assert result.state.type.value == "CANCELLING"
            # the worker answers the cancel while the flow process is held (by a kill, on the old code: the
            # run then ends, its return cut)
            wait_for(lambda: _logged(run_id, f"flow run {run_id} was cancelled after its work had ended")
                     or _state(run_id).is_final(), timeout=90, what="the worker's answer to the cancel")
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: _state(run_id).is_final(), timeout=120, what="the run's end")
        with get_client(sync_client=True) as client:
            final = client.read_flow_run(run_id).state
            history = [(s.type.value, s.name) for s in client.read_flow_run_states(run_id)]
        again = subprocess.run([q.exe, "cancel", run_id, "--pool", str(q.pool)], capture_output=True, text=True,
                               cwd=q.root)
    manifest = _manifest(out)
    assert (manifest["status"], manifest["reason"], manifest["run_id"]) == ("completed", "finished", run_id)
    assert sorted(f["path"] for f in manifest["files"]) == ["part-0.bin", "part-1.bin", "part-2.bin", "record.json"]
    assert not (out / "partial").exists()
    assert list((tmp_path / "scratch-n1").rglob("return-pending.json")) == []
    assert (final.type.value, final.name) == ("COMPLETED", "Completed")
    assert ("CANCELLED", "Cancelled") not in history, history
    assert again.returncode == 1 and re.fullmatch(
        rf"e31: cancel: no queued or running job '{run_id}' in pool {q.name}: the run \({run_id[:8]}\) ended "
        r"Completed at \d\d:\d\d(:\d\d)? UTC: nothing to cancel\n", again.stderr), again.stderr


def test_the_work_ended_tag_counts_only_for_the_attempt_that_wrote_it():
    """A run requeued after a crash (its ``run_count`` grew) can be cancelled
    again: the tag of an earlier attempt's ended work does not count."""
    from types import SimpleNamespace

    from e31.tasks.supervisor.marks import work_ended_at

    tags = ["e31", "gpus:0", "e31-work-ended:1:2026-12-03T18:41:37Z"]
    assert work_ended_at(SimpleNamespace(tags=tags, run_count=1)) == "2026-12-03T18:41:37Z"
    assert work_ended_at(SimpleNamespace(tags=tags, run_count=2)) is None
    assert work_ended_at(SimpleNamespace(tags=["e31"], run_count=1)) is None
