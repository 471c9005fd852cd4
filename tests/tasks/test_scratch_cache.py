"""The staged copies of a node's scratch: eviction down to a budget (least
recently used first, never a copy in use or kept), the data folder's lock,
and the markers of transfers under way.  Real files and real locks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from e31.specs import DataInput
from e31.tasks.stage import stage_input
from e31.tasks.storage.scratch_cache import (data_in_use, evict, release_data, remove_torn, staged_copies,
                                             take_data, try_hold_data)
from e31.tasks.storage.transfer_markers import mark_starting, transferring, transfers_busy


def _stage(tmp_path, root, job: str, size: int, used: float) -> None:
    src = tmp_path / "src" / f"{job}.bin"
    src.parent.mkdir(exist_ok=True)
    src.write_bytes(os.urandom(size))
    data = root / job / "data"
    data.mkdir(parents=True)
    stage_input(DataInput(name="x", url=str(src)), data)
    os.utime(data / "x.stage.json", (used, used))


def test_eviction_takes_the_least_recently_used_copies_first_and_spares_those_in_use_or_kept(tmp_path):
    root = tmp_path / "scratch"
    for job, used in (("old", 1000.0), ("busy", 500.0), ("kept", 700.0), ("mid", 2000.0), ("new", 3000.0)):
        _stage(tmp_path, root, job, 100, used)
    assert [(c.job, c.bytes, c.used) for c in staged_copies(root)] == [
        ("busy", 100, 500.0), ("kept", 100, 700.0), ("old", 100, 1000.0), ("mid", 100, 2000.0), ("new", 100, 3000.0)]
    take_data(root / "busy")  # a run holds it
    try:
        assert data_in_use(root / "busy") and not data_in_use(root / "old")
        assert evict(root, 450, 600, keep={"kept"}) == (False, [])  # busy + kept (200) + 450 > 600
        assert len(staged_copies(root)) == 5  # nothing removed when it cannot fit
        fits, gone = evict(root, 150, 500, keep={"kept"})
        assert fits and [(c.job, c.name) for c in gone] == [("old", "x"), ("mid", "x")]
        assert sorted(c.job for c in staged_copies(root)) == ["busy", "kept", "new"]
        assert not (root / "old" / "data" / "x").exists() and not (root / "old" / "data" / "x.stage.json").exists()
        assert evict(root, 100, 500) == (True, [])  # 300 + 100 fit: nothing to do
    finally:
        release_data(root / "busy")
    assert not data_in_use(root / "busy")


def test_the_data_folder_is_held_by_one_at_a_time_and_torn_copies_are_removed(tmp_path):
    scratch = tmp_path / "job"
    with try_hold_data(scratch) as held:
        assert held
        with try_hold_data(scratch) as again:
            assert not again  # a second prefetch (or one while a run holds it) never waits
    (scratch / "data" / ".x.part-0badf00d").mkdir(parents=True)
    (scratch / "data" / ".x.part-0badf00d" / "half").write_bytes(b"12")
    (scratch / "data" / "x").mkdir()
    assert remove_torn(scratch / "data") == [".x.part-0badf00d"]
    assert sorted(os.listdir(scratch / "data")) == ["x"]


def test_a_transfer_marker_counts_while_its_process_lives(tmp_path):
    assert not transfers_busy(tmp_path)
    with transferring("job", tmp_path):
        assert transfers_busy(tmp_path)
    assert not transfers_busy(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    marker = tmp_path / f"gone.{int(dead.stdout)}"
    marker.touch()  # a process killed while it staged
    assert not transfers_busy(tmp_path) and not marker.exists()


def test_a_flow_process_started_by_a_worker_counts_from_its_start_until_its_staging_ends(tmp_path):
    mark_starting("job", os.getpid(), tmp_path)  # the worker, as the flow process starts
    assert transfers_busy(tmp_path) and os.listdir(tmp_path) == [f"job.{os.getpid()}"]
    with transferring("job", tmp_path):  # that process's staging takes the marker over
        assert os.listdir(tmp_path) == [f"job.{os.getpid()}"]
    assert not transfers_busy(tmp_path) and os.listdir(tmp_path) == []


def test_a_flow_process_forked_warm_takes_over_the_marker_of_the_pid_its_worker_knows(tmp_path, monkeypatch):
    client = os.getppid()  # a live process other than this one: the warm start's client
    mark_starting("job", client, tmp_path)
    monkeypatch.setenv("E31_FLOW_PROCESS_PID", str(client))
    with transferring("job", tmp_path):
        assert os.listdir(tmp_path) == [f"job.{client}"]
    assert not transfers_busy(tmp_path) and os.listdir(tmp_path) == []


def test_a_copy_without_its_record_is_the_first_to_go(tmp_path):
    root = tmp_path / "scratch"
    _stage(tmp_path, root, "kept", 100, 1000.0)
    orphan = root / "torn" / "data" / "x"  # moved into place, then killed before its record was written
    orphan.mkdir(parents=True)
    (orphan / "f").write_bytes(b"a" * 50)
    assert [(c.job, c.bytes, c.used) for c in staged_copies(root)] == [("torn", 50, 0.0), ("kept", 100, 1000.0)]
    fits, gone = evict(root, 10, 110)
    assert fits and [c.job for c in gone] == ["torn"] and not orphan.exists()


def test_a_run_kills_a_prefetch_that_does_not_yield_and_ignores_a_dead_waiter(tmp_path):
    import signal
    import time

    from e31.tasks.storage.scratch_cache import yield_wanted

    scratch = tmp_path / "job"
    scratch.mkdir()
    holder = textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({str(scratch / "data.lock")!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        print("held", flush=True)
        time.sleep(600)  # a download whose source stopped sending: no chunk, so no check of the yield request
    """)
    # its command line names the prefetcher's module, as the real one's does
    proc = subprocess.Popen([sys.executable, "-c", holder, "e31.deployments.prefetch"], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        started = time.monotonic()
        waited = take_data(scratch, yield_s=1.0)
        assert 1.0 <= waited < 10 and time.monotonic() - started < 10
        assert proc.wait(10) == -signal.SIGKILL
        assert not (scratch / "data.wanted").exists()
    finally:
        proc.kill()
        release_data(scratch)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (scratch / "data.wanted").write_text(dead.stdout.strip())  # a run killed while it waited
    assert not yield_wanted(scratch) and not (scratch / "data.wanted").exists()
    (scratch / "data.wanted").write_text(str(os.getpid()))  # a live waiter
    assert yield_wanted(scratch)
