"""A benchmark stopped by SIGTERM or SIGINT leaves nothing behind.

``bench_queue.py`` is started as a real process with the smallest run it
has (one node, two jobs of a long sleep, no baseline) and stopped with
SIGTERM once its first job's work is running: its Prefect server, ``e31
scheduler``, ``e31 worker``, the flow process the worker started and the
work itself must all be gone when it exits (143 = 128 + SIGTERM), and so
must its temporary folder.  The shared helper (``tests/benchmarks/cleanup.py``)
is also run alone with a small tree of children, one of them escaped into
a session of its own, and stopped with SIGINT, by an exception, and by a
normal end.

Every process a benchmark starts is found here by an environment variable
this test sets (``E31_CLEANUP_TEST``) that all of them inherit, so the test
does not depend on the helper's own marker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from e31.tasks.supervisor.process import processes_where

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TEST_VAR = "E31_CLEANUP_TEST"
#: The work's source in bench_queue.py (its WORK): how a running job's work is told among the processes.
WORK_TEXT = "time.sleep(float(sys.argv[1]))"


def _marked(token: str) -> list[int]:
    """Live processes carrying ``E31_CLEANUP_TEST=token`` (zombies carry no environment)."""
    mark = f"{TEST_VAR}={token}".encode()
    return processes_where(lambda environ: mark in environ)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _await(condition, timeout: float, what: str, proc: subprocess.Popen):
    """Poll ``condition()`` until truthy (returned); fails after ``timeout`` s or when ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        if proc.poll() is not None:
            pytest.fail(f"the benchmark exited ({proc.returncode}) before {what}:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)


@pytest.fixture
def marked_run(tmp_path):
    """(token, env, tmp folder) for one benchmark process; every process
    still carrying the token is SIGKILLed at the end, whatever the outcome."""
    token = uuid.uuid4().hex
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, TEST_VAR: token, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    started: list[subprocess.Popen] = []
    yield token, env, tmp, started
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for _ in range(20):
        left = _marked(token)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)


@pytest.mark.server  # the benchmark starts a Prefect server of its own
def test_bench_queue_stopped_by_sigterm_leaves_no_process_and_no_folder(marked_run):
    token, env, tmp, started = marked_run
    bench = subprocess.Popen(
        [sys.executable, str(HERE / "bench_queue.py"), "--jobs", "2", "--nodes", "1", "--inputs", "1",
         "--work-s", "120", "--no-baseline"],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started.append(bench)

    def working():  # the first job's work is running: the server, scheduler, worker and a flow process are up
        pids = _marked(token)
        return pids if any(WORK_TEXT in _cmdline(p) for p in pids) else None

    before = _await(working, 150, "the first job's work runs", bench)
    lines = {p: _cmdline(p) for p in before}
    assert any("prefect server start" in c or "prefect.cli" in c and "server" in c for c in lines.values()), lines
    assert any(" scheduler --pool " in c for c in lines.values()), lines
    assert any(" worker --pool " in c and c.endswith(" --node n ") for c in lines.values()), lines  # one node: n
    assert [p for p, c in lines.items() if WORK_TEXT in c], lines
    folders = list(tmp.glob("e31-bench-queue-*"))
    assert len(folders) == 1 and (folders[0] / "scratch-1").is_dir(), folders

    os.kill(bench.pid, signal.SIGTERM)
    t0 = time.monotonic()
    try:
        out, _ = bench.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"bench_queue still running 60 s after SIGTERM; its processes: {_marked(token)}")
    stop_s = time.monotonic() - t0

    left = {p: _cmdline(p) for p in _marked(token)}
    assert left == {}, f"left running after the benchmark exited: {left}"
    shared = f"e31-transfers-{os.getuid()}"  # E31's machine-wide transfer markers (E31_TRANSFERS_DIR), not the run's
    assert [p.name for p in tmp.iterdir() if p.name != shared] == [], out  # its folder, the workers' e31-warm-*
    assert bench.returncode == 128 + signal.SIGTERM, out
    assert "bench_queue: stopped by SIGTERM" in out, out
    print(f"stopped {len(before)} processes in {stop_s:.1f} s:", *lines.values(), sep="\n  ")


#: A benchmark in miniature: a folder, a child group (a shell and its sleep), a child that escapes into its own
#: session (a grandchild after ``setsid``), then ``ready``; then it ends as argv[2] says.
MINI = """
import os, subprocess, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.benchmarks.cleanup import Cleanup, spawn
from e31.tasks.supervisor.process import processes_where
with Cleanup("mini") as cleanup:
    root = cleanup.tempdir("e31-bench-mini-")
    (root / "data").write_text("x")
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    spawn(["sh", "-c", "sleep 300 & sleep 301; wait"], server=True, **quiet)
    spawn(["sh", "-c", "sleep 302 & wait"], **quiet)
    subprocess.Popen(["setsid", "sleep", "303"], **quiet)
    mark = ("E31_CLEANUP_TEST=" + os.environ["E31_CLEANUP_TEST"]).encode()
    def sleeping():
        return [p for p in processes_where(lambda e: mark in e) if open(f"/proc/{p}/cmdline", "rb").read().startswith(b"sleep")]
    while len(sleeping()) < 4:
        time.sleep(0.05)
    print("ready", root, flush=True)
    if sys.argv[2] == "raise":
        raise RuntimeError("boom")
    if sys.argv[2] == "wait":
        time.sleep(300)
print("ended", flush=True)
"""


def _sleeps(token: str) -> list[int]:
    return [p for p in _marked(token) if _cmdline(p).startswith("sleep ")]


@pytest.mark.parametrize("end, rc, said", [
    ("sigint", 128 + signal.SIGINT, "mini: stopped by SIGINT"),
    ("sigterm", 128 + signal.SIGTERM, "mini: stopped by SIGTERM"),
    ("raise", 1, "RuntimeError: boom"),
    ("normal", 0, "ended"),
])
def test_cleanup_stops_its_children_and_removes_its_folder(marked_run, end, rc, said):
    token, env, tmp, started = marked_run
    mini = subprocess.Popen([sys.executable, "-c", MINI, str(REPO), "wait" if end.startswith("sig") else end],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    started.append(mini)
    ready = _await(lambda: mini.stdout.readline(), 60, "the mini benchmark is ready", mini)
    assert ready.startswith("ready "), ready
    root = Path(ready.split()[1])
    if end.startswith("sig"):
        assert len(_sleeps(token)) == 4 and root.is_dir()
        os.kill(mini.pid, signal.SIGINT if end == "sigint" else signal.SIGTERM)
    out, _ = mini.communicate(timeout=60)
    assert mini.returncode == rc, out
    assert said in out, out
    assert {p: _cmdline(p) for p in _marked(token)} == {}
    assert not root.exists()
    assert list(tmp.iterdir()) == []
