"""A run's devices are free only once its processes are gone: a node taken
for lost while its run's work lives on is fenced (e31.tasks.supervisor.fence).
Real server, scheduler and workers (tests/deployments/test_queue.py's
Queue); real kills.  The node's GPUs are told with E31_NODE_GPUS (this
machine has none): the works record the CUDA_VISIBLE_DEVICES they got."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from tests.deployments.test_queue import _gone, _warm_listening, queue, wait_for


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
