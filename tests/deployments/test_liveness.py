"""How the queue judges liveness: on the Prefect server's clock, with
heartbeats that a busy process does not hold back, in words that tell a
late worker from a lost one.

The clock skew is real for the processes that have it: their
``CLOCK_REALTIME`` (``time.time()``, ``datetime.now()``) is shifted by a
small ``LD_PRELOAD`` library compiled here (``SKEW_C``), the way
``libfaketime`` shifts it; the monotonic clock and every timed wait are the
kernel's own.  (``libfaketime`` 0.9.10, Debian's, breaks Python 3.11's
``time.sleep`` and timed waits, so it is not used.)  Nothing of E31 reads
the variable that sets the shift: only the library does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.deployments.test_queue import queue, wait_for

SKEW_C = textwrap.dedent("""
    /* Shifts this process's CLOCK_REALTIME by E31_TEST_SKEW_S seconds (tests only). */
    #define _GNU_SOURCE
    #include <dlfcn.h>
    #include <stdlib.h>
    #include <sys/time.h>
    #include <time.h>

    typedef int (*clock_gettime_t)(clockid_t, struct timespec *);

    static long long skew_ns(void) {
        static int read = 0;
        static long long ns = 0;
        if (!read) {
            const char *text = getenv("E31_TEST_SKEW_S");
            ns = text ? (long long)(atof(text) * 1e9) : 0;
            read = 1;
        }
        return ns;
    }

    int clock_gettime(clockid_t id, struct timespec *ts) {
        static clock_gettime_t real = 0;
        if (!real) real = (clock_gettime_t)dlsym(RTLD_NEXT, "clock_gettime");
        int done = real(id, ts);
        if (done == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
            long long t = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + skew_ns();
            ts->tv_sec = t / 1000000000LL;
            ts->tv_nsec = t % 1000000000LL;
        }
        return done;
    }

    int gettimeofday(struct timeval *tv, void *tz) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        if (tv) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
        return 0;
    }

    time_t time(time_t *out) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        if (out) *out = ts.tv_sec;
        return ts.tv_sec;
    }
""")


@pytest.fixture(scope="module")
def skew_library(tmp_path_factory) -> Path:
    """The shifting library, compiled with the machine's C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the clock-shifting library (cc)")
    folder = tmp_path_factory.mktemp("skew")
    (folder / "skew.c").write_text(SKEW_C)
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(folder / "skew.so"), str(folder / "skew.c"),
                    "-ldl"], check=True)
    return folder / "skew.so"


def skewed(library: Path, seconds: float) -> dict[str, str]:
    """The environment that shifts a process's clock by ``seconds``."""
    return {"LD_PRELOAD": str(library), "E31_TEST_SKEW_S": str(seconds)}


def test_the_shifting_library_shifts_the_wall_clock_only(skew_library):
    """The library itself: ``time.time()`` 75 s ahead, sleeps and timed
    waits as long as asked."""
    probe = ("import threading, time; t = time.time(); m = time.monotonic(); time.sleep(0.2); "
             "threading.Event().wait(0.2); print(t, time.monotonic() - m)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          env={**os.environ, **skewed(skew_library, 75)})
    shifted, waited = map(float, done.stdout.split())
    assert 74 < shifted - time.time() < 76 and 0.4 <= waited < 5


def _skew_line(seconds: str, side: str) -> str:
    return (f"this machine's clock is {seconds} s {side} the Prefect server's; leases are judged on the server's "
            "clock; fix the clock (NTP)")


def _said_skew(text: str, prefix: str, side: str) -> str | None:
    """The skew line ``text`` holds, or None: 74-76 s for a 75 s shift (the server's ``Date`` has whole
    seconds)."""
    found = re.search(rf"^{re.escape(prefix)}this machine's clock is (\d+) s {side} the Prefect server's; .*$",
                      text, re.M)
    if found is None:
        return None
    assert found.group(1) in ("74", "75", "76"), found.group(0)
    assert found.group(0) == prefix + _skew_line(found.group(1), side)
    return found.group(0)


def test_the_server_s_clock_is_read_from_the_date_of_its_answers():
    """``ServerClock``: each answer bounds the offset (from ``Date`` minus
    its arrival to ``Date`` + 1 s minus its sending); the estimate is the
    middle of the tightest bounds, the lower one when a ``Date`` written a
    moment early crosses them, and none within ``RESOLUTION_S``.  No
    ``Date``, a bad one or a slow answer (over ``SLOW_S``) is no sample.
    The skew line beyond ``SKEW_WARN_S``."""
    from e31.prefect_compat.clock import SKEW_WARN_S, SLOW_S, ServerClock, skew_line

    clock = ServerClock()
    assert clock.offset() is None
    noon = 1_796_300_000.0  # Thu, 03 Dec 2026 12:13:20 GMT
    clock.observe("Thu, 03 Dec 2026 12:13:20 GMT", noon + 74.9, noon + 75.3)  # this machine 75 s ahead
    assert clock.offset() == pytest.approx(-74.6)  # between -75.3 and -73.9
    clock.observe("Thu, 03 Dec 2026 12:13:22 GMT", noon + 77.0, noon + 77.05)  # just past the server's second
    assert clock.offset() == pytest.approx(-74.525)  # between -75.05 and -74.0
    clock.observe("Thu, 03 Dec 2026 12:13:25 GMT", noon + 80.9, noon + 80.95)  # just before its next second
    assert clock.offset() == pytest.approx(-74.975)  # between -75.05 and -74.9
    clock.observe("Thu, 03 Dec 2026 12:13:25 GMT", noon + 81.5, noon + 81.6)  # a Date written 0.6 s early
    assert clock.offset() == pytest.approx(-75.05)  # the bounds crossed: the lower one
    for date, took in ((None, 0.1), ("yesterday", 0.1), ("Thu, 03 Dec 2026 12:14:20 GMT", SLOW_S + 0.1)):
        clock.observe(date, noon, noon + took)
    assert clock.offset() == pytest.approx(-75.05)
    same = ServerClock()
    same.observe("Thu, 03 Dec 2026 12:13:20 GMT", noon + 0.1, noon + 0.3)  # between -0.3 and 0.9: one clock
    assert same.estimate() == pytest.approx(0.3) and same.offset() == 0.0
    assert skew_line(-75.05) == _skew_line("75", "ahead of")
    assert skew_line(75.6) == _skew_line("76", "behind")
    assert skew_line(-SKEW_WARN_S) is None and skew_line(SKEW_WARN_S) is None


def test_a_scheduler_75_s_ahead_of_the_server_places_at_once_and_says_its_clock_is_off(prefect_api, tmp_path,
                                                                                         skew_library):
    """Issue 33 item 9: with the scheduler's clock 75 s ahead of the
    server's, every worker looked silent past the 60 s lease and nothing was
    placed.  Judged on the server's clock, a job is placed at once; the
    scheduler, a worker whose clock is 75 s behind and ``e31 queue`` (ahead)
    each say the skew in one line, and ``e31 queue`` neither calls the
    worker silent nor the pool unserved."""
    with queue(tmp_path, {"n1": 0}) as q:
        q.start("scheduler", "scheduler", "--pool", str(q.pool), "--interval", "0.5", env=skewed(skew_library, 75))
        q.start("worker-n1", "worker", "--pool", str(q.pool), "--node", "n1",
                env={"E31_SCRATCH": str(q.root / "scratch-n1"), **skewed(skew_library, -75)})
        q.submit(q.job("skewed", 0, 0.5))
        submitted = time.monotonic()
        wait_for(lambda: (q.root / "out" / "skewed" / "record.json").exists(), timeout=150,
                 what="the job placed by a scheduler 75 s ahead")  # old code: never (at each tick, a lost node)
        print(f"submitted to run in {time.monotonic() - submitted:.1f} s (the worker's start included)")
        wait_for(lambda: _said_skew((q.root / "scheduler.log").read_text(), "e31 scheduler: ", "ahead of"),
                 timeout=30, what="the scheduler's word on its clock")
        wait_for(lambda: _said_skew((q.root / "worker-n1.log").read_text(), "e31 worker: ", "behind"),
                 timeout=30, what="the worker's word on its clock")
        shown = subprocess.run([q.exe, "queue", "--pool", str(q.pool)], capture_output=True, text=True, cwd=q.root,
                               env={**os.environ, **skewed(skew_library, 75)})
        assert shown.returncode == 0, shown.stderr
        [worker] = [line for line in shown.stdout.splitlines() if line.startswith("n1 ")]
        heard = re.search(r"heard (\d+) s ago$", worker)
        assert heard is not None and int(heard.group(1)) <= 20, worker
        assert shown.stderr == f"{_said_skew(shown.stderr, 'e31: ', 'ahead of')}\n", shown.stderr


BUSY = textwrap.dedent("""
    import sys, time
    from e31.deployments import scheduler
    from e31.specs.pool import load_pool

    real_tick, busy_s = scheduler.tick, float(sys.argv[2])

    def slow_tick(*args, **kwargs):  # a tick busy with its own work: a CPU-bound loop in this process
        end, n = time.monotonic() + busy_s, 0
        while time.monotonic() < end:
            n += sum(i * i for i in range(1000))
        return real_tick(*args, **kwargs)

    scheduler.tick = slow_tick
    scheduler.serve(load_pool(sys.argv[1]), interval_s=0.5)
""")


def test_a_scheduler_busy_with_a_long_tick_still_beats_within_its_interval(prefect_api, tmp_path):
    """Issue 34 item 1: the pool's claim was renewed between ticks, so a
    tick that took 30 s on a loaded machine let it go stale and ``e31
    queue`` said no scheduler served the pool.  Its own thread beats every
    :data:`BEAT_S` while each tick runs a CPU-bound loop for 35 s in the
    scheduler's process."""
    from prefect.client.orchestration import get_client

    from e31.deployments.presence import BEAT_S, read_claim, scheduler_note

    with queue(tmp_path, {"n1": 0}) as q:
        (q.root / "busy.py").write_text(BUSY)
        log = open(q.root / "scheduler.log", "wb")
        q.procs["scheduler"] = subprocess.Popen([sys.executable, str(q.root / "busy.py"), str(q.pool), "35"],
                                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        beats: list[float] = []
        with get_client(sync_client=True) as client:
            wait_for(lambda: read_claim(client, q.name) is not None, what="the scheduler's claim")
            notes = set()
            until = time.monotonic() + 40  # the first tick (35 s of CPU) and beyond
            while time.monotonic() < until:
                beat = read_claim(client, q.name)["beat"]
                if not beats or beat != beats[-1]:
                    beats.append(beat)
                notes.add(scheduler_note(client, q.name, str(q.pool)))
                time.sleep(0.5)
        gaps = [round(b - a, 1) for a, b in zip(beats, beats[1:])]
        print(f"beats {len(beats)}, gaps (s) {gaps}")
        assert len(beats) >= 4 and max(gaps) <= 1.5 * BEAT_S, gaps  # old code: one beat, then none for 35 s
        assert notes == {None}, notes


BUSY_WORKER = textwrap.dedent("""
    import sys, time
    from e31.deployments.worker import E31Worker
    from e31.flows.cli import main

    real_poll, busy_s, once = E31Worker._get_scheduled_flow_runs, float(sys.argv[3]), []

    async def busy_poll(self):  # a poll that blocks the worker's event loop with a CPU-bound loop, once
        ready = getattr(self, "_beats", None) is not None if hasattr(self, "_beats") else \\
            getattr(self, "_has_successfully_synced", False)  # (a worker without a heartbeat thread: once synced)
        if not once and ready:
            once.append(1)
            print("busy", time.time(), flush=True)
            end = time.monotonic() + busy_s
            while time.monotonic() < end:
                sum(i * i for i in range(1000))
            print("free", time.time(), flush=True)
        return await real_poll(self)

    E31Worker._get_scheduled_flow_runs = busy_poll
    sys.exit(main(["worker", "--pool", sys.argv[1], "--node", sys.argv[2]]))
""")


def test_a_worker_whose_event_loop_is_blocked_still_heartbeats(prefect_api, tmp_path):
    """Issue 34 item 1: a worker's heartbeat is sent from its event loop
    (Prefect's), so a loop held by the worker's own work for 35 s left its
    node silent past two heartbeats and it looked late (past a short lease,
    lost).  Its own thread beats every 10 s meanwhile."""
    from prefect.client.orchestration import get_client

    from e31.flows.queue import work_pool_name
    from e31.specs.pool import load_pool

    with queue(tmp_path, {"n1": 0}) as q:
        q.scheduler()  # creates the work pool
        (q.root / "busy_worker.py").write_text(BUSY_WORKER)
        log = open(q.root / "worker-n1.log", "wb")
        q.procs["worker-n1"] = subprocess.Popen(
            [sys.executable, str(q.root / "busy_worker.py"), str(q.pool), "n1", "35"], stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True, cwd=q.root,
            env={**os.environ, "E31_SCRATCH": str(q.root / "scratch-n1")})
        said = q.root / "worker-n1.log"
        wait_for(lambda: "busy " in said.read_text(), what="the worker's blocked poll")
        pool = work_pool_name(load_pool(q.pool))
        beats: list[float] = []
        with get_client(sync_client=True) as client:
            while "free " not in said.read_text():
                [worker] = [w for w in client.read_workers_for_work_pool(pool) if w.name == "n1"]
                beat = worker.last_heartbeat_time.timestamp()
                if not beats or beat != beats[-1]:
                    beats.append(beat)
                time.sleep(0.5)
        busy, free = (float(re.search(rf"^{w} (\S+)$", said.read_text(), re.M).group(1)) for w in ("busy", "free"))
        gaps = [round(b - a, 1) for a, b in zip(beats, beats[1:])]
        print(f"loop blocked {free - busy:.1f} s; heartbeats {len(beats)}, gaps (s) {gaps}")
        assert free - busy >= 35 and len(beats) >= 3 and max(gaps) <= 15, gaps  # old code: none while blocked


def _run(key: str, node: str, run_count: int):
    """A Prefect flow run (the schema object the API returns) placed on ``node``."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.states import Running

    return FlowRun(id=uuid.UUID(key), flow_id=uuid.uuid4(), run_count=run_count, state=Running(),
                   parameters={"placement": {"e31_node": node, "gpu_devices": [0], "cpus": 1}})


def test_e31_queue_tells_a_late_worker_from_a_lost_one():
    """Issue 34 items 1 and 10: a worker just past two heartbeats is late
    (its runs keep their resources until the lease's end), past the lease it
    takes nothing new, and only past the lease and its confirmation is it
    lost; only runs with retries left are said to be queued again."""
    from e31.deployments.runwords import node_lines, silent_note
    from e31.flows.placement import Node, RunningJob
    from e31.flows.queue.cache import LOST_CONFIRM_S
    from e31.flows.queue.snapshot import Snapshot
    from e31.specs import JobSpec

    def spec(retries: int) -> JobSpec:
        return JobSpec.model_validate({
            "name": f"job{retries}", "work": {"kind": "simulation", "command": ["true"]},
            "request": {"gpus": 1, "cpus": 1, "duration": "1m", "retries": retries},
            "output": {"kind": "results", "url": "/tmp/out", "files": ["r.json"]}})

    a, b, c = (str(uuid.UUID(int=i)) for i in (1, 2, 3))
    now = 1_796_300_000.0  # 2026-12-03 12:13:20 UTC
    snap = Snapshot(now=now, nodes=[Node("g", gpus=2, cpus=4, memory=2**30), Node("idle", gpus=0, cpus=4,
                                                                                     memory=2**30)],
                    runs={a: _run(a, "g", 1), b: _run(b, "g", 1)}, specs={a: spec(1), b: spec(0)},
                    running=[RunningJob(id=k, node="g", devices=(i,), cpus=1, memory=0, start=now - 100,
                                        expected_end=now + 100) for i, k in enumerate((a, b))],
                    lease_s=60.0, scheduler_heard=True, heard={"g": now - 21, "idle": now - 21})
    assert node_lines(snap, now) == [
        ("g", "GPUs 2/2, CPUs 2/4, memory 0 B/1 GiB; 2 run(s)",
         "late: last heard 21 s ago; its runs keep their resources until the lease ends at 12:13:59 UTC"),
        ("idle", "CPUs 0/4, memory 0 B/1 GiB; 0 run(s)",
         "late: last heard 21 s ago; it holds no run; nothing new is placed here from the lease's end at "
         "12:13:59 UTC until it is heard again")]
    assert silent_note(snap, "g", now) == "; node g's worker is late: last heard 21 s ago"
    snap.heard = {"g": now - 20, "idle": now - 3}
    assert [w for _, _, w in node_lines(snap, now)] == ["heard 20 s ago", "heard 3 s ago"]
    # past the lease: e31 queue's snapshot takes the node's runs for lost (they leave `running`)
    snap.running, snap.lost, snap.heard = [], [a, b], {"g": now - 70, "idle": now - 70}
    assert node_lines(snap, now)[0][2] == (
        "late: last heard 70 s ago, past the lease that ended at 12:13:10 UTC: nothing new is placed here; its runs "
        "keep their resources unless it is still silent at 12:13:25 UTC, when it is lost")
    assert node_lines(snap, now)[1][2] == ("late: last heard 70 s ago, past the lease that ended at 12:13:10 UTC: "
                                           "nothing is placed here until it is heard again")
    gone = now - 60 - LOST_CONFIRM_S - 1
    snap.heard = {"g": gone, "idle": gone}
    assert node_lines(snap, now)[0][2] == (
        "lost: last heard 76 s ago, past the lease that ended at 12:13:04 UTC: nothing is placed here until its "
        "worker is heard again; its 2 run(s) are crashed: 1 queued again (retries left), 1 not queued again (no "
        "retries left)")
    assert node_lines(snap, now)[1][2] == ("lost: last heard 76 s ago, past the lease that ended at 12:13:04 UTC: "
                                           "nothing is placed here until its worker is heard again")
    assert silent_note(snap, "g", now) == "; node g's worker is lost: last heard 76 s ago"
    snap.lost, snap.runs[c], snap.specs[c] = [b], _run(c, "g", 2), spec(0)
    snap.scheduler_heard = False
    assert node_lines(snap, now)[0][2] == (
        "lost: last heard 76 s ago, past the lease that ended at 12:13:04 UTC (60 s unless e31 scheduler --lease "
        "says otherwise; no scheduler heard): nothing is placed here until its worker is heard again; its 1 run(s) "
        "are crashed once an e31 scheduler runs: 1 not queued again (no retries left)")


def test_e31_queue_calls_a_stopped_worker_late_and_its_run_keeps_its_node(prefect_api, tmp_path):
    """A real silent worker (SIGSTOP) with a running job: past two
    heartbeats ``e31 queue`` calls it late, not lost, with the lease's end
    (its last heartbeat, as the server recorded it, plus the 60 s lease);
    heard again once it goes on (SIGCONT)."""
    import signal

    from prefect.client.orchestration import get_client

    from e31.flows.placement.text import clock
    from e31.flows.queue import work_pool_name
    from e31.specs.pool import load_pool

    with queue(tmp_path, {"n1": 0}) as q:
        q.scheduler()
        worker = q.worker("n1", 0)
        q.submit(q.job("long", 0, 240))
        wait_for(lambda: (q.root / "out" / "long").exists() or
                 (q.root / "scratch-n1" / "long" / "output" / "started.json").exists(), what="the job's start")

        def shown() -> tuple[str, str]:
            done = subprocess.run([q.exe, "queue", "--pool", str(q.pool)], capture_output=True, text=True,
                                  cwd=q.root)
            assert done.returncode == 0, done.stderr
            [node] = [line for line in done.stdout.splitlines() if line.startswith("n1 ")]
            [job] = [line for line in done.stdout.splitlines() if line.startswith("long ")]
            return node, job

        os.kill(worker.pid, signal.SIGSTOP)  # the worker process alone: its flow process and the work go on
        try:
            seen: list[tuple[str, str]] = []
            wait_for(lambda: seen.append(shown()) or "late: " in seen[-1][0], timeout=120, what="a late worker")
            with get_client(sync_client=True) as client:
                [me] = [w for w in client.read_workers_for_work_pool(work_pool_name(load_pool(q.pool)))
                        if w.name == "n1"]
                beat = me.last_heartbeat_time.timestamp()
            node, job = seen[-1]
            late = re.search(r"late: last heard (\d+) s ago; its runs keep their resources until the lease ends at "
                             r"(.+)$", node)
            assert late is not None and 20 <= int(late.group(1)) <= 60, node  # past 20 s, shown rounded
            assert late.group(2) == clock(beat + 60, beat + 60), node
            assert job.endswith(f"; node n1's worker is late: last heard {late.group(1)} s ago"), job
            assert " Running " in job, job  # it keeps its node
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        wait_for(lambda: re.search(r"heard \d+ s ago$", shown()[0]) is not None, timeout=60, what="heard again")
