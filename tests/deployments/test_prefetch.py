"""Prefetch against a real ``prefect server start`` (and the test S3 server): a queued job's inputs
are staged on the node it is planned on while it waits (``e31 worker``'s
prefetcher), within the node's ``scratch_budget``; a prefetch killed with
its worker leaves nothing a run reuses."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import final_manifest
from tests.deployments.test_queue import queue, wait_for

MiB = 2**20


def _pool(q, nodes: list[str], budget: str) -> None:
    q.pool.write_text(json.dumps({"pool_version": 1, "name": q.name, "nodes": [
        {"name": n, "gpus": 1, "cpus": 2, "memory": "1GiB", "scratch_budget": budget} for n in nodes]}))


def _input(q, name: str, mib: int) -> tuple[list, str]:
    """A local input file of ``mib`` MiB; returns the spec's data list and its sha256."""
    path = q.root / "inputs" / f"{name}.bin"
    path.parent.mkdir(exist_ok=True)
    block = hashlib.sha256(name.encode()).digest() * (MiB // 32)
    path.write_bytes(block * mib)
    return [{"name": "blob", "url": str(path)}], hashlib.sha256(path.read_bytes()).hexdigest()


def _run_id(submitted: str) -> str:
    return submitted.split("flow run ")[1].split()[0]


def _started(q, node: str, job: str) -> bool:
    return (q.root / f"scratch-{node}" / job / "output" / "started.json").exists()


def test_a_job_waiting_behind_another_has_its_inputs_staged_before_it_starts(prefect_api, tmp_path):
    with queue(tmp_path, {}) as q:
        _pool(q, ["n1", "n2"], "200MiB")
        q.scheduler("--handover", "0")  # the late job waits queued (not handed over 10 s before a holder's end)
        q.worker("n1", 1)
        q.worker("n2", 1)
        # unequal: the node planned for the late job (the one that frees first) frees first under any load
        # hold-1 long enough that the prefetch, at the lowest CPU priority on a busy machine, and the listing
        # after it are done while the late job still waits (15 s was not, once, with the machine busy)
        q.submit(q.job("hold-1", 1, 25))
        q.submit(q.job("hold-2", 1, 55))
        wait_for(lambda: all(any(_started(q, n, j) for n in ("n1", "n2")) for j in ("hold-1", "hold-2")),
                 what="both holders running")
        data, digest = _input(q, "late", 30)
        late = _run_id(q.submit(q.job("late", 1, 2, data=data)))
        scratches = {n: q.root / f"scratch-{n}" / "late" / "data" for n in ("n1", "n2")}
        wait_for(lambda: any((d / ".prefetch.json").exists() for d in scratches.values()), timeout=60,
                 what="the prefetch")
        node = next(n for n, d in scratches.items() if (d / ".prefetch.json").exists())
        note = json.loads((scratches[node] / ".prefetch.json").read_text())
        listed = subprocess.run([q.exe, "queue", "--pool", str(q.pool)], capture_output=True, text=True, cwd=q.root)
        assert listed.returncode == 0 and listed.stdout.startswith("JOB"), (listed.stdout, listed.stderr)
        assert not _started(q, node, "late")  # staged while the job waited
        wait_for(lambda: final_manifest(q.root / "out" / "late"), timeout=120, what="the late job's manifest")
        manifest = final_manifest(q.root / "out" / "late")
        record = q.record("late")
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            tags = client.read_flow_run(late).tags
            placed = next(s for s in client.read_flow_run_states(late) if s.name == "Placed")
            started = client.read_flow_run(late).start_time
    assert note["run_id"] == late and note["node"] == node and note["bytes"] == 30 * MiB
    assert note["at"] < record["start"]
    staged = scratches[node] / "blob" / "late.bin"
    assert hashlib.sha256(staged.read_bytes()).hexdigest() == digest
    assert record["node"] == node  # it ran where it was prefetched ...
    assert {"e31-staged", f"e31-staged:{node}"} <= set(tags)  # ... which the prefetcher told the scheduler
    assert any(t.startswith("e31-staging-s:") for t in tags)
    assert placed.message.endswith("; inputs already staged there")
    line = next((x for x in listed.stdout.splitlines() if x.startswith("late ")), listed.stdout)
    assert re.search(rf"; inputs 30\.0 MiB of 30\.0 MiB staged on {node} before allocation, in \d+\.\d s$", line), line
    assert manifest["status"] == "completed"
    assert manifest["staged_before_allocation"] is True
    assert manifest["timings"]["prefetch_s"] == note["seconds"] > 0
    timings = manifest["timings"]
    # the meter bills its GPU from the work's start to the release: staging (the check of the copy) is not billed
    meter = manifest["meter"]
    assert meter["gpu_seconds"] == meter["seconds"] == round(meter["released_at"] - meter["started_at"], 3)
    # it starts after the flow run's staging (flow start + staging_s) and before the work's first line, and stops
    # after the work's last line and before the manifest is written; no upper bound on the gaps, which a busy
    # machine stretches (the flow's hand-over from run to return took 0.8 s once in CI)
    # (the flow run's start_time is its Running state's timestamp, a reading a few milliseconds from where the
    # flow's staging clock starts: 0.05 s of slack, far less than any billed gap)
    assert started.timestamp() + timings["staging_s"] - 0.05 <= meter["started_at"] <= record["start"]
    assert record["end"] <= meter["released_at"] <= (q.root / "out" / "late" / "manifest.json").stat().st_mtime + 0.001


def test_a_scratch_budget_too_small_for_two_jobs_evicts_the_older_copy(prefect_api, tmp_path):
    with queue(tmp_path, {}) as q:
        _pool(q, ["n1"], "50MiB")  # room for one 30 MiB input, not two
        q.scheduler("--policy", "fcfs",  # one job after the other, in the order submitted
                    "--handover", "0")  # the second waits queued behind the middle job (else handed over and
        # staged by its own flow process, not the prefetcher: a race CI lost once)
        q.worker("n1", 1)
        q.submit(q.job("holder", 1, 40))  # long enough that the first still waits when the second is submitted
        wait_for(lambda: _started(q, "n1", "holder"), what="the holder")
        first_data, _ = _input(q, "first", 30)
        second_data, second_digest = _input(q, "second", 30)
        q.submit(q.job("first", 1, 1, data=first_data))
        wait_for(lambda: (q.root / "scratch-n1" / "first" / "data" / ".prefetch.json").exists(), timeout=60,
                 what="the first job's prefetch")
        q.submit(q.job("middle", 1, 8))  # reads nothing; the second waits while it runs
        q.submit(q.job("second", 1, 1, data=second_data))
        assert final_manifest(q.root / "out" / "holder") is None  # the first still waits: the premise of the test
        wait_for(lambda: all(final_manifest(q.root / "out" / j) for j in ("holder", "first", "middle", "second")),
                 timeout=180, what="four jobs")
        log = (q.root / "worker-n1.log").read_text()
    first, second = (final_manifest(q.root / "out" / j) for j in ("first", "second"))
    assert first["staged_before_allocation"] is True and first["timings"]["prefetch_s"] > 0
    # the second did not fit beside the first's copy while the first waited (planned sooner, kept) ...
    assert re.search(r"e31 prefetch on n1: second \(\w{8}\): over budget \(its inputs to copy \(30\.0 MiB\) do not "
                     r"fit the node's scratch_budget \(50\.0 MiB\) beside the copies in use\)", log), log[-3000:]
    # ... and was prefetched while the middle job ran, evicting the first's copy, now unused
    assert re.search(r"e31 prefetch on n1: second \(\w{8}\): copied, 30\.0 MiB in [\d.]+ s; evicted to make room: first/blob",
                     log)
    assert not (q.root / "scratch-n1" / "first" / "data" / "blob").exists()
    assert not (q.root / "scratch-n1" / "first" / "data" / "blob.stage.json").exists()
    staged = q.root / "scratch-n1" / "second" / "data" / "blob" / "second.bin"
    assert hashlib.sha256(staged.read_bytes()).hexdigest() == second_digest
    assert second["status"] == "completed" and second["staged_before_allocation"] is True


def _prefetch_pids(pool: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"e31.deployments.prefetch" in cmd and str(pool).encode() in cmd:
            found.append(int(proc.name))
    return found


def test_a_prefetch_killed_with_its_worker_leaves_nothing_a_run_reuses(prefect_api, s3_server, s3_prefix, tmp_path):
    with queue(tmp_path, {}) as q:
        _pool(q, ["n1"], "1GiB")
        q.scheduler()
        worker = q.start("worker-n1", "worker", "--pool", str(q.pool), "--node", "n1",
                         env={"E31_NODE_GPUS": "1", "E31_SCRATCH": str(q.root / "scratch-n1"),
                              "E31_PREFETCH_RATE": "8MiB"})  # a slow copy, to be cut in the middle
        q.submit(q.job("holder", 1, 25))
        wait_for(lambda: _started(q, "n1", "holder"), what="the holder")
        local, digest = _input(q, "cut", 64)
        url = f"{s3_prefix}cut.bin"
        s3_server.filesystem().put_file(local[0]["url"], url)
        data = [{"name": "blob", "url": url}]
        q.submit(q.job("cut", 1, 1, data=data))
        folder = q.root / "scratch-n1" / "cut" / "data"

        def part_bytes() -> int:
            return sum(f.stat().st_size for f in folder.glob(".blob.part-*/**/*") if f.is_file())

        wait_for(lambda: folder.exists() and part_bytes() >= 8 * MiB, timeout=90, what="a prefetch under way")
        pids = _prefetch_pids(q.pool)
        assert len(pids) == 1
        os.kill(worker.pid, signal.SIGKILL)  # the worker alone: its prefetcher dies with it
        wait_for(lambda: not _prefetch_pids(q.pool), timeout=10, what="the prefetcher's end")
        torn = sorted(p.name for p in folder.iterdir())
        assert part_bytes() < 64 * MiB
        q.worker("n1", 1)  # the machine's worker again (no rate cap)
        wait_for(lambda: all(final_manifest(q.root / "out" / j) for j in ("holder", "cut")), timeout=180,
                 what="both jobs")
        manifest = final_manifest(q.root / "out" / "cut")
    assert len(torn) == 1 and torn[0].startswith(".blob.part-")  # no copy, no record: nothing a run would reuse
    assert manifest["status"] == "completed"
    staged = folder / "blob" / "cut.bin"
    assert hashlib.sha256(staged.read_bytes()).hexdigest() == digest
    assert not list(folder.glob(".blob.part-*"))  # the torn folder was removed


def test_a_run_that_wants_its_data_folder_stops_a_prefetch_within_a_chunk(tmp_path):
    """No server: a prefetch (rate-capped, holding the job's data folder)
    of a local file, and a run of the same job taking the folder."""
    import threading

    from e31.deployments.prefetch import Gate
    from e31.specs import DataInput
    from e31.tasks.stage import StagingCancelled, stage_input
    from e31.tasks.storage.scratch_cache import release_data, take_data, try_hold_data, yield_wanted
    from e31.tasks.supervisor.cancel import gate_staging

    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(2 * 64 * MiB))  # two sendfile steps; 16 MiB/s holds the first step back 4 s
    scratch = tmp_path / "scratch" / "job"
    data = scratch / "data"
    data.mkdir(parents=True)
    gate = Gate(stop=lambda: yield_wanted(scratch), busy=lambda: False, rate=16 * MiB)
    outcome: list = []

    def prefetch() -> None:
        with try_hold_data(scratch) as held:
            assert held
            with gate_staging(str(data), gate):
                try:
                    stage_input(DataInput(name="big", url=str(src)), data)
                    outcome.append("staged")
                except StagingCancelled as exc:
                    outcome.append(exc)

    thread = threading.Thread(target=prefetch)
    thread.start()
    deadline = time.monotonic() + 30
    while gate.done < 64 * MiB:  # the first step is copied; the gate holds the copy back
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    started = time.monotonic()
    take_data(scratch)  # the run: it asks the prefetch to yield, and waits for the folder
    waited = time.monotonic() - started
    release_data(scratch)
    thread.join(10)
    assert waited < 3.0  # the gate checks every 0.2 s; the capped copy would hold the folder 4 s or more
    assert len(outcome) == 1 and isinstance(outcome[0], StagingCancelled)
    assert sorted(os.listdir(data)) == []  # the half copy removed, no record: nothing a run would reuse
    assert not yield_wanted(scratch)
