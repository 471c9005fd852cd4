"""The work stays inside its job: every process it starts ends by the hard
stop (setsid() and double forks included), and ``request.memory`` is
enforced on its whole process tree.  Real processes, real kills."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from e31.flows.job import JobFailedError, run_job
from e31.specs import parse_spec

ESCAPER = """
import os, sys, time, pathlib
out = pathlib.Path(os.environ["E31_OUTPUT_DIR"])
if os.fork() == 0:          # a grandchild that leaves the session and the process group
    os.setsid()
    if os.fork() == 0:      # and double-forks
        (out / "escaped.pid").write_text(str(os.getpid()))
        time.sleep(3600)
    os._exit(0)
time.sleep(1)
(out / "result.txt").write_text("done")
"""


def _alive(pid: int) -> bool:
    from tests.flows.test_stops import _pid_gone

    return not _pid_gone(pid)


def _job(tmp_path: Path, name: str, code: str, **request) -> dict:
    return {"name": name, "work": {"kind": "processing", "command": [sys.executable, "-c", code]},
            "request": {"limit": "2m", "grace": "2s", **request},
            "output": {"kind": "files", "url": str(tmp_path / "out"), "files": ["result.txt"]}}


def test_a_grandchild_that_calls_setsid_and_double_forks_ends_with_the_job(prefect_api, scratch, tmp_path):
    """A grandchild that calls setsid() must not survive the stop and every
    later run (it did, 3 of 3)."""
    manifest = run_job(parse_spec(_job(tmp_path, "escaper", ESCAPER)))
    assert manifest["status"] == "completed"
    escaped = int((tmp_path / "out" / "escaped.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(escaped) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(escaped)


def test_memory_beyond_the_request_fails_the_job_with_its_peak(prefect_api, scratch, tmp_path):
    """With memory: 512MiB a work must not reach 3.3 GiB and complete.  The
    whole process tree is measured; past the request it is killed, the job
    fails with reason out_of_memory and the peak, and the checkpoint it had
    made comes back."""
    code = ("import os, pathlib, time\n"
            "ck = pathlib.Path(os.environ['E31_CHECKPOINT_DIR']) / 'step-1'; ck.mkdir()\n"
            "(ck / 'state.bin').write_bytes(b'x' * 1000); (ck / 'COMMITTED').write_text('')\n"
            "time.sleep(1.5)\n"
            "hog = [bytearray(64 * 2**20) for _ in range(12)]  # 768 MiB, touched\n"
            "time.sleep(30)\n")
    with pytest.raises(JobFailedError) as err:
        run_job(parse_spec(_job(tmp_path, "hog", code, memory="256MiB")))
    manifest = err.value.manifest
    assert (manifest["status"], manifest["reason"]) == ("failed", "out_of_memory")
    assert manifest["message"].startswith("the work used ") and manifest["message"].endswith(
        "of resident memory, over request.memory 256.0 MiB; killed. Ask for more memory, or use less")
    assert manifest["peak_memory_bytes"] > 256 * 2**20
    assert manifest["step"] == 1 and manifest["timings"]["run_s"] < 25  # killed, not left to sleep 30 s
    assert (tmp_path / "out" / "checkpoints" / "step-1" / "COMMITTED").is_file()
    assert json.loads((tmp_path / "out" / "partial" / "manifest.json").read_text())["reason"] == "out_of_memory"
