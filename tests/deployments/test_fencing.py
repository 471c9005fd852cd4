"""A run's devices are free only once its processes are gone: a node taken
for lost while its run's work lives on is fenced (e31.tasks.supervisor.fence).
Real server, scheduler and workers (tests/deployments/test_queue.py's
Queue); real kills.  The node's GPUs are told with E31_NODE_GPUS (this
machine has none): the works record the CUDA_VISIBLE_DEVICES they got."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

from tests.deployments.test_queue import STEPS, _done, _durable_step, _gone, _warm_listening, queue, wait_for


class _Deaths:
    """Polls pids every 20 ms in a thread: the time each was first seen gone."""

    def __init__(self, pids: list[int]):
        self.pids, self.gone_at, self._stop = list(pids), {}, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set() and len(self.gone_at) < len(self.pids):
            for pid in self.pids:
                if pid not in self.gone_at and _gone(pid):
                    self.gone_at[pid] = time.time()
            time.sleep(0.02)

    def last(self) -> float | None:
        """When the last of them was seen gone; None while one lives."""
        return max(self.gone_at.values()) if len(self.gone_at) == len(self.pids) else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _started(q, name: str, node: str) -> dict | None:
    try:
        return json.loads((q.root / f"scratch-{node}" / name / "output" / "started.json").read_text())
    except (OSError, ValueError):
        return None


def _state(client, run_id: str):
    return client.read_flow_run(run_id).state


def test_a_lost_run_s_node_takes_no_job_until_its_worker_started_again_kills_its_processes(prefect_api, tmp_path):
    """kill -9 of n1's worker alone while a 2-GPU job runs, its flow process
    hung (SIGSTOP: its own fence read cannot act) and its work running on.
    Past the lease the run is Crashed; a second 2-GPU job waits, naming the
    fence, and is not placed on n1 while the first work runs.  A worker
    started again on n1 kills the lost run's flow process and work (their
    pids gone), lifts the fence, and only then is the second job placed:
    its work starts after the first one's processes died, on the same
    devices.  Before, the worker started again looked only at runs still
    Pending/Running, and the second job ran beside the first work on the
    same devices."""
    from prefect.client.orchestration import get_client

    with queue(tmp_path, {"n1": 2}) as q:
        q.scheduler("--lease", "10")
        worker = q.worker("n1", 2)
        wait_for(lambda: _warm_listening(worker), what="n1's warm process")
        first = q.submit(q.job("first", 2, 200)).split("flow run ")[1].split()[0]
        wait_for(lambda: _started(q, "first", "n1") is not None, what="the first job's work")
        work = _started(q, "first", "n1")["pid"]
        flow = _parent(work)
        warm = _parent(flow)  # the warm process the flow process was forked from: never killed by the fence
        os.kill(flow, signal.SIGSTOP)  # a hung flow process: it reads nothing, its work runs on
        os.kill(worker.pid, signal.SIGKILL)  # the worker alone
        worker.wait()
        deaths = _Deaths([work, flow])
        try:
            with get_client(sync_client=True) as client:
                wait_for(lambda: _state(client, first).type.value == "CRASHED", timeout=120, what="the run lost")
                second = q.submit(q.job("second", 2, 1)).split("flow run ")[1].split()[0]
                wait_for(lambda: "e31 worker" in (_state(client, second).message or ""), timeout=60,
                         what="the second job's reason")
                assert _state(client, second).message.endswith(
                    "once the runs lost on node n1 are confirmed ended (by node n1's e31 worker, started again "
                    "there)"), _state(client, second).message
                assert not _gone(work) and _started(q, "second", "n1") is None
                q.start("worker-n1-again", "worker", "--pool", str(q.pool), "--node", "n1",
                        env={"E31_NODE_GPUS": "2", "E31_SCRATCH": str(q.root / "scratch-n1")})
                wait_for(lambda: _started(q, "second", "n1") is not None, timeout=120, what="the second job's work")
                second_start = _started(q, "second", "n1")
                wait_for(lambda: deaths.last() is not None, timeout=5, what="the first job's processes to be gone")
                assert deaths.last() < second_start["start"], (deaths.gone_at, second_start)
                assert second_start["devices"] == "0,1"
                assert _state(client, first).type.value == "CRASHED"
        finally:
            deaths.stop()
            for pid in (flow, work):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        log = (q.root / "worker-n1-again.log").read_text()
        assert f"flow run {first} no longer holds node n1 (lost with it while its worker was silent)" in log, log
        killed = [int(p) for p in re.search(rf"flow run {first} no longer holds node n1 .*?\(pids \[([0-9, ]+)\]\)",
                                            log).group(1).split(", ")]
        assert flow in killed and work in killed and warm not in killed, (killed, warm)
        assert f"flow run {first} (first), lost with node n1: no process of it remains on this machine; the " \
               "node's fence is lifted" in log


def test_a_requeued_run_waits_for_its_lost_attempt_until_the_operator_declares_its_node_down(prefect_api, tmp_path):
    """A run lost with n1 (no worker: lost at once without a run cache) is
    fenced; queued again, it is held back with the fence's reason (its
    attempt on n1 may still run) while n1 is held by the fence's stand-in.
    ``e31 node n1 --down`` (the machine is off) lets it be planned; n1 stays
    fenced until its worker confirms."""
    from datetime import datetime, timedelta, timezone

    from prefect.client.orchestration import get_client
    from prefect.states import Running, Scheduled

    from e31.deployments.nodes import declare_down
    from e31.flows.queue import apply, read
    from tests.conftest import place_by_hand
    from tests.deployments.test_run_cache import _Pool

    made = _Pool(tmp_path)
    with get_client(sync_client=True) as client:
        run = made.submit(client, "lost")
        place_by_hand(client, run, "n1")
        client.set_flow_run_state(run, Running(), force=True)
        assert apply(client, read(client, made.spec), [])["lost"] == 1
        client.set_flow_run_state(run, Scheduled(name="Queued", scheduled_time=datetime.now(timezone.utc) + timedelta(
            seconds=120)), force=True)  # as the scheduler requeues it
        snap = read(client, made.spec)
        assert [j.id for j in snap.queued] == [] and snap.blocked == {run: (
            "waiting for its attempt on node n1, lost while it ran, to be confirmed ended: by that attempt's flow "
            "process or node n1's e31 worker (started again there); if that machine is off for good: e31 node n1 "
            "--down --pool POOL")}
        assert [r.id for r in snap.running] == ["~fenced~n1"]
        assert [(f["run"], f["down"]) for f in declare_down(client, made.spec.name, "n1")] == [(run, True)]
        snap = read(client, made.spec)
        assert [j.id for j in snap.queued] == [run] and snap.blocked == {}
        assert [r.id for r in snap.running] == ["~fenced~n1"]


def _attempt(q, name: str, node: str) -> list[str] | None:
    """The last line of job ``name``'s ``attempts.txt`` on ``node`` (STEPS: start step, the work's pid, node,
    Unix time of its start), or None before its work starts."""
    try:
        return (q.root / f"scratch-{node}" / name / "output" / "attempts.txt").read_text().splitlines()[-1].split()
    except (OSError, IndexError):
        return None


def _retried_job_lost_on_n1(q, name: str) -> tuple[str, int, int]:
    """Start the scheduler (``--lease 10``) and n1's worker, submit job
    ``name`` (STEPS, 240 steps of 0.5 s, one retry) and wait until it has
    three durable steps on n1; then start n2's worker.  Returns the run
    id, its work's pid and its flow process's pid."""
    q.scheduler("--lease", "10")
    worker = q.worker("n1", 0)
    wait_for(lambda: _warm_listening(worker), what="n1's warm process")
    run = q.submit(q.job(name, 0, 240, work="steps.py", cpus=2, retries=1)).split("flow run ")[1].split()[0]
    wait_for(lambda: _durable_step(q.root / "out" / name / "checkpoints") >= 3, what="three durable steps on n1")
    work = int(_attempt(q, name, "n1")[1])
    q.worker("n2", 0)  # ready for the retry from the moment it is queued
    return run, work, _parent(work)


def test_a_requeued_run_starts_elsewhere_only_after_its_lost_attempt_s_processes_are_gone(prefect_api, tmp_path):
    """kill -9 of n1's worker alone while a job with a retry runs there:
    its flow process and work live on.  Past the lease the run is crashed,
    n1 fenced, and the run queued again; n2's worker runs all along.  The
    first attempt's flow process sees its run crashed and stops itself
    (kills its work, lifts its fence): the second attempt's work on n2
    starts after both processes are gone (timestamps), resumes from the
    first's newest durable checkpoint, and no fence is left.  Before
    fencing, the attempt on n2 started while the first still ran (0.6 s
    overlap on a loaded machine, up to the flow process's 10 s read)."""
    from prefect.client.orchestration import get_client

    from e31.tasks.supervisor.fence import read_fences

    with queue(tmp_path, {"n1": 0, "n2": 0}) as q:
        (q.root / "steps.py").write_text(STEPS)
        run, work, flow = _retried_job_lost_on_n1(q, "moved")
        deaths = _Deaths([work, flow])
        try:
            os.kill(q.procs["worker-n1"].pid, signal.SIGKILL)  # the worker alone
            q.procs["worker-n1"].wait()
            wait_for(lambda: _attempt(q, "moved", "n2") is not None, timeout=180, what="the attempt on n2")
            started = float(_attempt(q, "moved", "n2")[3])
            wait_for(lambda: deaths.last() is not None, timeout=5, what="the first attempt's processes to be gone")
            assert deaths.last() < started, (deaths.gone_at, started)
        finally:
            deaths.stop()
            for pid in (flow, work):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        wait_for(lambda: _done(q, "moved"), timeout=300, what="the job")
        record = json.loads((q.root / "out" / "moved" / "record.json").read_text())
        assert record["node"] == "n2" and record["resumed_from"] >= 3
        with get_client(sync_client=True) as client:
            assert read_fences(client, q.name) == {}  # lifted by the first flow process (n1's worker never came back)
            wait_for(lambda: client.read_flow_run(run).state.is_final(), what="its final state")
            assert client.read_flow_run(run).state.type.value == "COMPLETED"


def test_a_requeued_run_whose_lost_attempt_hangs_starts_elsewhere_only_once_its_node_is_declared_down(
        prefect_api, tmp_path, e31):
    """As above, but the first attempt's flow process hangs (SIGSTOP: it
    reads nothing, its work runs on) and n1's worker never comes back: the
    requeued run waits, saying why, and nothing of it starts on n2 however
    long; ``e31 node n1 --down`` (the operator: the machine is off) lets
    it start on n2, after the word (timestamps); n1 stays fenced."""
    from prefect.client.orchestration import get_client

    from e31.tasks.supervisor.fence import read_fences

    with queue(tmp_path, {"n1": 0, "n2": 0}) as q:
        (q.root / "steps.py").write_text(STEPS)
        run, work, flow = _retried_job_lost_on_n1(q, "hung")
        try:
            os.kill(flow, signal.SIGSTOP)  # a hung flow process: its own fence read cannot act
            os.kill(q.procs["worker-n1"].pid, signal.SIGKILL)
            q.procs["worker-n1"].wait()
            with get_client(sync_client=True) as client:
                wait_for(lambda: (_state(client, run).message or "").startswith(
                    "Queued: waiting for its attempt on node n1, lost while it ran, to be confirmed ended"),
                    timeout=180, what="the run queued again, waiting for the fence")
                assert _attempt(q, "hung", "n2") is None and not _gone(work)
                down_at = time.time()
                done = e31("node", "n1", "--pool", str(q.pool), "--down")
                assert done.returncode == 0 and done.stdout.startswith("node n1: declared down: "), done
                wait_for(lambda: _attempt(q, "hung", "n2") is not None, timeout=180, what="the attempt on n2")
                assert float(_attempt(q, "hung", "n2")[3]) > down_at
                assert [(f["node"], f["run"], f["down"]) for f in read_fences(client, q.name).values()] == [
                    ("n1", run, True)]
        finally:
            for pid in (flow, work):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        wait_for(lambda: _done(q, "hung"), timeout=300, what="the job")
        assert json.loads((q.root / "out" / "hung" / "record.json").read_text())["node"] == "n2"


def _two_node_pool(root: Path):
    """A pool of its own on the session server (n1, n2: no worker runs for
    either, so their runs are lost at once without a run cache), its file
    ``pool.yaml`` and the base job template its runs are submitted with."""
    import uuid

    from e31.deployments.worker import E31Worker
    from e31.specs.pool import load_pool

    path = root / "pool.yaml"
    path.write_text(json.dumps({"pool_version": 1, "name": f"f{uuid.uuid4().hex[:8]}", "nodes": [
        {"name": n, "gpus": 0, "cpus": 1, "memory": "1GiB"} for n in ("n1", "n2")]}))
    return load_pool(str(path)), path, E31Worker.get_default_base_job_template()


def _submit(client, pool, template, root: Path, name: str) -> str:
    from e31.flows.deploy import parameters
    from e31.flows.queue import submit
    from tests.deployments.test_run_cache import _spec

    return str(submit(client, pool, parameters(_spec(name, root), None), ["e31"], template).id)


def _requeue(client, run: str) -> None:
    """Queue the crashed run again, as the scheduler does for a run with retries left."""
    from datetime import datetime, timedelta, timezone

    from prefect.states import Scheduled

    client.set_flow_run_state(run, Scheduled(name="Queued", scheduled_time=datetime.now(timezone.utc) + timedelta(
        seconds=120)), force=True)


def test_a_run_lost_again_on_a_second_node_fences_that_node_too_and_each_node_lifts_only_its_own(prefect_api,
                                                                                                  tmp_path):
    """A run lost on n1 (declared down: its fence stays until n1's worker
    confirms), requeued and lost again on n2, fences n2 as well, and its
    next attempt waits for n2's: one fence per run and node.  The flow
    process on n2 lifting its fence leaves n1's.  Before, the fence was
    named by the run alone: n2 was never fenced (the run's fence already
    existed), the down fence let a third attempt start beside n2's, and a
    lift from either node removed the other's."""
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from e31.deployments.nodes import declare_down
    from e31.flows.queue import apply, read
    from e31.tasks.supervisor.fence import fence_name, lift_fence, read_fences
    from tests.conftest import place_by_hand

    pool, _, template = _two_node_pool(tmp_path)
    with get_client(sync_client=True) as client:
        run = _submit(client, pool, template, tmp_path, "twice-lost")
        place_by_hand(client, run, "n1")
        client.set_flow_run_state(run, Running(), force=True)
        assert apply(client, read(client, pool), [])["lost"] == 1
        _requeue(client, run)
        declare_down(client, pool.name, "n1")
        place_by_hand(client, run, "n2")
        client.set_flow_run_state(run, Running(), force=True)
        assert apply(client, read(client, pool), [])["lost"] == 1
        fences = read_fences(client, pool.name)
        assert sorted((f["node"], f["down"]) for f in fences.values()) == [("n1", True), ("n2", False)]
        assert sorted(fences) == sorted([fence_name(run, "n1"), fence_name(run, "n2")])
        assert client.read_flow_run(run).state.type.value == "CRASHED"
        _requeue(client, run)
        snap = read(client, pool)
        assert snap.queued == [] and snap.blocked == {run: (
            "waiting for its attempt on node n2, lost while it ran, to be confirmed ended: by that attempt's flow "
            "process or node n2's e31 worker (started again there); if that machine is off for good: e31 node n2 "
            "--down --pool POOL")}
        assert sorted(r.id for r in snap.running) == ["~fenced~n1", "~fenced~n2"]
        assert lift_fence(run, "n2")  # as n2's flow process does once its work is killed
        assert [(f["node"], f["down"]) for f in read_fences(client, pool.name).values()] == [("n1", True)]
        snap = read(client, pool)
        assert [j.id for j in snap.queued] == [run] and snap.blocked == {}
        assert sorted(r.id for r in snap.running) == ["~down~n2", "~fenced~n1"]  # n2: no worker there


def test_a_run_that_ends_by_itself_as_its_node_is_taken_for_lost_leaves_no_fence(prefect_api, tmp_path):
    """The scheduler's tick sees a run Running on a node silent past the
    lease, and its flow process writes Completed before the tick's crash:
    the tick leaves the run Completed and writes no fence.  Before, the
    fence was written first and the crash then skipped as stale: the fence
    outlived the run, holding its node."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Running

    from e31.flows.queue import RunCache, apply, read
    from e31.tasks.supervisor.fence import read_fences
    from tests.conftest import place_by_hand

    pool, _, template = _two_node_pool(tmp_path)
    with get_client(sync_client=True) as client:
        run = _submit(client, pool, template, tmp_path, "ends-itself")
        place_by_hand(client, run, "n1")
        client.set_flow_run_state(run, Running(), force=True)
        cache = RunCache(pool, full_every_s=3600)
        cache.silent_since = {"n1": time.monotonic() - 3600}  # silent past the lease, confirmed
        snap = read(client, pool, cache=cache)
        assert snap.lost == [run]
        client.set_flow_run_state(run, Completed())  # its flow process ends the run meanwhile
        assert apply(client, snap, [], cache=cache)["lost"] == 0
        assert client.read_flow_run(run).state.type.value == "COMPLETED"
        assert read_fences(client, pool.name) == {}
        cache.close()


def test_e31_queue_and_e31_node_say_a_node_is_fenced_since_when_by_which_run_and_what_lifts_it(prefect_api, tmp_path,
                                                                                                 e31):
    """``e31 queue``'s node table: a fenced node's worker column says since
    when, by which lost run, and what lifts the fence; after ``e31 node n1
    --down``, that only its worker started again does.  ``e31 node`` takes a
    node dropped from the pool file while a fence names it (its run's retry
    waits on it)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from e31.flows.placement.text import clock
    from e31.flows.queue import apply, read
    from e31.tasks.supervisor.fence import read_fences
    from tests.conftest import place_by_hand

    pool, path, template = _two_node_pool(tmp_path)
    with get_client(sync_client=True) as client:
        run = _submit(client, pool, template, tmp_path, "shown")
        place_by_hand(client, run, "n1")
        client.set_flow_run_state(run, Running(), force=True)
        assert apply(client, read(client, pool), [])["lost"] == 1
        (fence,) = read_fences(client, pool.name).values()

    def node_row(node: str) -> str:
        done = e31("queue", "--pool", str(path))
        assert done.returncode == 0, done.stderr
        return next(line for line in done.stdout.splitlines() if line.startswith(f"{node}  "))

    since, unheard = fence["since"], "no worker heard: nothing starts here until one runs (e31 worker --node n1)"
    row = node_row("n1")
    assert row.endswith(
        f"  {unheard}; fenced since {clock(since, since)} by shown ({run[:8]}), lost there while running: nothing "
        f"is placed here until its processes are confirmed gone (by its flow process, or by the e31 worker started "
        f"again there); if the machine is off for good: e31 node n1 --pool {path} --down"), row
    assert "fenced" not in node_row("n2")
    done = e31("node", "n1", "--pool", str(path), "--down")
    assert (done.returncode, done.stdout, done.stderr) == (0, (
        f"node n1: declared down: the attempts of shown ({run[:8]}) there count as ended, and their retries may "
        "start on other nodes; n1 takes no new job until its e31 worker starts there again and finds nothing of "
        "them left\n"), "")
    assert node_row("n1").endswith(
        f"  {unheard}; fenced since {clock(since, since)} by shown ({run[:8]}), lost there while running, declared "
        "down: nothing is placed here until the e31 worker started again there finds nothing of it left")
    only_n2 = tmp_path / "only-n2.yaml"  # n1 taken out of the pool file after it was lost
    only_n2.write_text(json.dumps({**json.loads(path.read_text()), "nodes": [
        {"name": "n2", "gpus": 0, "cpus": 1, "memory": "1GiB"}]}))
    done = e31("node", "n1", "--pool", str(only_n2))
    assert (done.returncode, done.stdout) == (0, (
        f"node n1: fenced: shown ({run[:8]}) was lost there while running; declared down: it takes no new job until "
        "its e31 worker starts there again\n")), done.stderr
    done = e31("node", "n3", "--pool", str(only_n2))
    assert (done.returncode, done.stdout, done.stderr) == (1, "", (
        f"e31: node: no node 'n3' in pool {pool.name} (its nodes: n2); give one of them\n"))


def test_a_run_named_in_the_worker_s_own_environment_does_not_get_its_warm_process_or_forks_killed(prefect_api,
                                                                                                   tmp_path):
    """``e31 worker`` started from a flow run on its node (its environment
    names that run and the node: PREFECT__FLOW_RUN_ID, E31_NODE), the run
    queued in another pool: ``/proc`` shows that environment for its warm
    process and every fork of it, whatever run each fork runs.  The
    worker's fence checks (at its start and each heartbeat) kill neither
    its warm process nor the flow process of the job it runs: the job
    completes, forked warm, and the warm process lives on.  Before, both
    were taken for that other run's processes and killed."""
    from prefect.client.orchestration import get_client

    from tests.deployments.test_queue import _warm_processes

    (tmp_path / "other").mkdir()
    other, _, template = _two_node_pool(tmp_path / "other")
    with get_client(sync_client=True) as client:
        decoy = _submit(client, other, template, tmp_path, "decoy")  # queued, placed nowhere: no scheduler there
    with queue(tmp_path, {"n1": 0}) as q:
        q.scheduler()
        worker = q.start("worker-n1", "worker", "--pool", str(q.pool), "--node", "n1", env={
            "E31_NODE_GPUS": "0", "E31_SCRATCH": str(q.root / "scratch-n1"), "E31_NODE": "n1",
            "PREFECT__FLOW_RUN_ID": decoy})
        wait_for(lambda: _warm_listening(worker), what="the worker's warm process")
        (warm,) = _warm_processes(worker)
        q.submit(q.job("kept", 0, 25))
        wait_for(lambda: _started(q, "kept", "n1") is not None, what="the job's work")
        assert _parent(_parent(_started(q, "kept", "n1")["pid"])) == warm  # its flow process is a fork of it
        wait_for(lambda: _done(q, "kept"), timeout=240, what="the job")  # 25 s: two heartbeats at least
        assert json.loads((q.root / "out" / "kept" / "record.json").read_text())["node"] == "n1"
        assert not _gone(warm) and _warm_processes(worker) == [warm]
        assert "no longer holds node" not in (q.root / "worker-n1.log").read_text()


def test_a_placed_run_lost_with_its_node_is_queued_again_at_once_without_a_fence(prefect_api, tmp_path):
    """A run only Placed on n1 (its worker had not taken it: Prefect's
    worker proposes Pending before it starts a flow process) when n1 is
    taken for lost has no process anywhere: it is queued again at the same
    tick, saying so, with no fence, and planned at the next read.  Before,
    n1 was fenced as if the run had been lost there while running, and the
    requeued run waited for that fence."""
    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    from e31.flows.queue import apply, read
    from e31.tasks.supervisor.fence import read_fences
    from tests.conftest import place_by_hand

    pool, _, template = _two_node_pool(tmp_path)
    with get_client(sync_client=True) as client:
        run = _submit(client, pool, template, tmp_path, "only-placed")
        place_by_hand(client, run, "n1")
        client.set_flow_run_state(run, Scheduled(name="Placed", message="starts now on n1"), force=True)
        counts = apply(client, read(client, pool), [])
        assert (counts["lost"], counts["requeued"]) == (0, 1)
        assert read_fences(client, pool.name) == {}
        state = client.read_flow_run(run).state
        assert (state.type.value, state.name, state.message) == ("SCHEDULED", "Queued", (
            "Queued again: node n1 stopped answering (no worker heartbeat for 60 s) before its worker took the run; "
            "nothing of it ran there, which uses none of its retries"))
        assert client.read_flow_run(run).parameters["placement"] == {"e31_attempt": 0}
        snap = read(client, pool)
        assert [j.id for j in snap.queued] == [run] and snap.blocked == {}
        assert sorted(r.id for r in snap.running) == ["~down~n1", "~down~n2"]


def _lock_pid(q, name: str, node: str, run: str) -> int | None:
    """The pid that holds job ``name``'s lock on ``node`` for flow run ``run`` (its flow process), or None."""
    from e31.flows.joblock import lock_holder

    pid, holder = lock_holder(str(q.root / f"scratch-{node}" / name))
    return pid if holder == run and pid is not None and not _gone(pid) else None


def test_a_handed_over_run_lost_while_it_waits_is_queued_again_without_a_retry_and_its_stopped_fork_is_killed(
        prefect_api, tmp_path):
    """H2 (no retries) handed over behind H1 (checkpointing, 2 retries) on
    n1 waits, Running in Prefect, holding nothing; both flow processes are
    hung (SIGSTOP: warm forks; H2's has no work below it) and n1's worker
    killed (-9).  Past the lease both runs are Crashed; H2's work never
    started, so it is queued again without using a retry (it was left
    Crashed: Prefect had counted its wait as an attempt).  n1's worker
    started again kills H1's and H2's stopped flow processes (H2's found
    by its job's lock: /proc shows a warm fork the warm process's
    environment) before it lifts their fences (it said 'no process of it
    remains' while H2's fork lived); both jobs then complete on n1, H1
    resuming from its checkpoint."""
    from prefect.client.orchestration import get_client

    with queue(tmp_path, {"n1": 2}) as q:
        (q.root / "steps.py").write_text(STEPS)
        q.scheduler("--lease", "10")
        worker = q.worker("n1", 2)
        wait_for(lambda: _warm_listening(worker), what="n1's warm process")
        h1 = q.submit(q.job("H1", 2, 30, work="steps.py", duration="6s", retries=2)).split("flow run ")[1].split()[0]
        wait_for(lambda: _durable_step(q.root / "out" / "H1" / "checkpoints") >= 1, what="a durable step of H1")
        h2 = q.submit(q.job("H2", 2, 1, retries=0)).split("flow run ")[1].split()[0]
        with get_client(sync_client=True) as client:
            wait_for(lambda: _lock_pid(q, "H2", "n1", h2) is not None and _state(client, h2).type.value == "RUNNING",
                     what="H2 handed over, its flow process waiting")
            assert client.read_flow_run(h2).parameters["placement"]["e31_after"] == h1
            work = int(_attempt(q, "H1", "n1")[1])
            flows = [_parent(work), _lock_pid(q, "H2", "n1", h2)]
            try:
                for pid in flows:
                    os.kill(pid, signal.SIGSTOP)
                os.kill(worker.pid, signal.SIGKILL)
                worker.wait()
                assert _started(q, "H2", "n1") is None  # its work never started
                wait_for(lambda: (_state(client, h2).message or "").startswith(
                    "Queued: waiting for its attempt on node n1, lost while it ran, to be confirmed ended"),
                    timeout=120, what="H2 queued again, waiting for its fence")
                assert "Queued again: it crashed before its work started, which uses none of its retries" in [
                    s.message for s in client.read_flow_run_states(h2)]
                assert not any(_gone(pid) for pid in flows)
                q.start("worker-n1-again", "worker", "--pool", str(q.pool), "--node", "n1",
                        env={"E31_NODE_GPUS": "2", "E31_SCRATCH": str(q.root / "scratch-n1")})
                wait_for(lambda: _done(q, "H1", "H2"), timeout=150, what="both jobs")
                assert all(_gone(pid) for pid in flows)
            finally:
                for pid in (*flows, work):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, TypeError):
                        pass
            wait_for(lambda: all(_state(client, r).is_final() for r in (h1, h2)), what="final states")
            assert [_state(client, r).type.value for r in (h1, h2)] == ["COMPLETED", "COMPLETED"]
        assert json.loads((q.root / "out" / "H1" / "record.json").read_text())["resumed_from"] >= 1
        log = (q.root / "worker-n1-again.log").read_text()
        killed = re.search(rf"flow run {h2} no longer holds node n1 \(lost with it while its worker was silent\): "
                           r"its processes here \(pids \[([0-9, ]+)\]\) killed\n", log)
        assert killed and flows[1] in [int(p) for p in killed.group(1).split(", ")], log
        assert log.index(f"flow run {h2} no longer holds node n1") < log.index(
            f"flow run {h2} (H2), lost with node n1: no process of it remains on this machine")
