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
