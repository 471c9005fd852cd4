"""What the planner and ``e31 queue`` make of a run's current attempt and of
its node's worker: a run queued again after a crash is planned from the
start of its new attempt, the node table counts what every run there holds
whatever its worker's liveness, and a job waiting for a node without a live
worker says so rather than that a resource is short.  Flow runs come from a
real ``prefect server start`` where their states matter; word tests build
the Snapshot from real Prefect ``FlowRun`` objects."""

from __future__ import annotations

import os
import time
import uuid
from datetime import datetime, timezone

from tests.conftest import place_by_hand
from tests.deployments.test_liveness import skew_library  # noqa: F401 (a fixture)
from tests.deployments.test_run_cache import _Pool


def test_a_run_placed_again_after_a_crash_is_planned_from_its_placement(prefect_api, tmp_path):
    """A run that ran once (``run_count`` 1), crashed, was queued again and
    placed anew (as the scheduler's requeue and placement write it) is
    shown to the planner starting at its ``Placed`` time, not at its first
    attempt's start (Prefect's ``start_time``), whose planned end is past;
    ``Pending`` likewise, and ``Running`` once more at that state's time."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Pending, Running, Scheduled

    from e31.flows.queue import read, work_pool_name

    made = _Pool(tmp_path)
    with get_client(sync_client=True) as client:
        run = made.submit(client, "again", duration="100s")
        place_by_hand(client, run, "n1")
        client.set_flow_run_state(run, Running(), force=True)
        first = client.read_flow_run(run)
        assert first.run_count == 1 and first.start_time is not None
        client.set_flow_run_state(run, Crashed(message="Process exited with status code: -9."), force=True)
        client.set_flow_run_state(run, Scheduled(name="Queued", scheduled_time=datetime.now(timezone.utc)),
                                  force=True)
        time.sleep(1.1)  # the states' times (and the first start) differ by more than a rounding
        place_by_hand(client, run, "n1")
        client.set_flow_run_state(run, Scheduled(name="Placed", scheduled_time=datetime.now(timezone.utc)),
                                  force=True)
        client.send_worker_heartbeat(work_pool_name(made.spec), "n1")  # n1 is live: its run holds it

        def planned() -> tuple[float, float, float]:
            now = client.read_flow_run(run)
            snap = read(client, made.spec)
            [held] = [r for r in snap.running if r.id == run]
            return held.start, held.expected_end - held.start, now.state.timestamp.timestamp()

        start, span, placed = planned()
        assert (start, span) == (placed, 100.0)  # old code: the first attempt's start, over 1 s earlier
        assert placed - first.start_time.timestamp() > 1.0
        client.set_flow_run_state(run, Pending(), force=True)
        start, span, pending = planned()
        assert (start, span) == (pending, 100.0)
        client.set_flow_run_state(run, Running(), force=True)
        assert client.read_flow_run(run).run_count == 2
        start, span, running = planned()
        assert (start, span) == (running, 100.0)


def test_the_returning_state_is_the_one_cutreturn_writes():
    """The snapshot keeps a ``Returning`` run's first start (its work has
    ended): it names the state as the worker writes it."""
    from e31.deployments.cutreturn import RETURNING
    from e31.flows.queue.snapshot import RETURNING as SEEN

    assert SEEN == RETURNING


def _utc(hms: str) -> float:
    return datetime.strptime(f"2026-12-03 {hms}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()


def _uuid(i: int) -> str:
    return str(uuid.UUID(int=i))



def test_the_scheduler_stamps_its_tick_lines_with_the_server_s_clock(prefect_api, tmp_path, skew_library):
    """A scheduler whose machine's clock is 75 s ahead of the Prefect
    server's stamps each tick line with the server's time (as the runs'
    states and the heartbeats it speaks of are), not its own."""
    import re
    import subprocess

    from tests.deployments.test_liveness import skewed
    from tests.deployments.test_queue import queue

    with queue(tmp_path, {"n1": 0}) as q:  # no worker: the job waits, and the tick that says so is reported
        q.submit(q.job("stamped", 0, 1))
        before = time.time()  # this machine's clock is the server's (the server runs here)
        done = subprocess.run([q.exe, "scheduler", "--pool", str(q.pool), "--once"], capture_output=True, text=True,
                              cwd=q.root, env={**os.environ, **skewed(skew_library, 75)}, timeout=300)
        after = time.time()
        assert done.returncode == 0, done.stderr
        [stamp] = re.findall(r"^(\d\d):(\d\d):(\d\d) 1 queued, 0 running: 1 wait ", done.stdout, re.M)
        said = int(stamp[0]) * 3600 + int(stamp[1]) * 60 + int(stamp[2])
        day = 86400
        low, high = int(before) % day - 1, int(after) % day + 1  # whole seconds; the server's Date has whole ones
        assert (said - low) % day <= (high - low) % day, (done.stdout, before, after)  # old code: 75 s later


def _spec(name: str, gpus: int = 0, cpus: int = 1, memory: str = "256MiB", retries: int = 1):
    from e31.specs import JobSpec

    return JobSpec.model_validate({
        "name": name, "work": {"kind": "simulation", "command": ["true"]},
        "request": {"gpus": gpus, "cpus": cpus, "memory": memory, "duration": "100s", "retries": retries},
        "output": {"kind": "results", "url": "/tmp/out", "files": ["r.json"]}})


def _flow_run(key: str, node: str | None, state, run_count: int, start: str | None = None, devices=(), cpus=1):
    """A Prefect flow run (the schema object the API returns), placed on ``node``."""
    from prefect.client.schemas.objects import FlowRun

    placement = {"e31_node": node, "gpu_devices": list(devices), "cpus": cpus} if node else {}
    return FlowRun(id=uuid.UUID(key), flow_id=uuid.uuid4(), run_count=run_count, state=state,
                   start_time=datetime.fromtimestamp(_utc(start), timezone.utc) if start else None,
                   parameters={"placement": placement})


def _at(state, hms: str):
    state.timestamp = datetime.fromtimestamp(_utc(hms), timezone.utc)
    return state


def test_e31_queue_counts_what_a_silent_node_s_runs_hold_and_shows_their_current_attempt():
    """A node silent past the lease (its runs taken for lost by ``e31
    queue``'s snapshot, not yet crashed) still has them holding it: the node
    table counts their GPUs, CPUs and memory and the runs, as the job table
    lists them; a run in its second attempt (``run_count`` 2, ``Running``
    since 12:10) shows 12:10 as its START, not its first attempt's 11:00."""
    from prefect.states import Running

    from e31.deployments.runwords import node_lines
    from e31.flows.placement import Node
    from e31.flows.queue.snapshot import Snapshot

    a, b = _uuid(1), _uuid(2)
    now = _utc("12:13:20")
    snap = Snapshot(now=now, nodes=[Node("g", gpus=2, cpus=4, memory=2**30)],
                    runs={a: _flow_run(a, "g", _at(Running(), "12:10:00"), 2, "11:00:00", devices=(0,), cpus=2),
                          b: _flow_run(b, "g", _at(Running(), "12:05:00"), 1, "12:05:00", devices=(1,))},
                    specs={a: _spec("again", gpus=1, cpus=2), b: _spec("first", gpus=1)},
                    lost=[a, b], lease_s=60.0, scheduler_heard=True, heard={"g": now - 70})
    assert node_lines(snap, now) == [
        ("g", "GPUs 2/2, CPUs 3/4, memory 512 MiB/1 GiB; 2 run(s)",
         "late: last heard 70 s ago, past the lease that ended at 12:13:10 UTC: nothing new is placed here; its runs "
         "keep their resources unless it is still silent at 12:13:25 UTC, when it is lost")]
    from e31.deployments.runwords import job_rows  # (the job table was cmd_queue's own before)

    assert job_rows(snap, []) == [
        ("JOB", "RUN", "STATE", "NODE", "GPUS", "START", "REASON"),
        ("again", a[:8], "Running", "g", "0", "12:10 UTC", "running; node g's worker is late: last heard 70 s ago"),
        ("first", b[:8], "Running", "g", "1", "12:05 UTC", "running; node g's worker is late: last heard 70 s ago")]
