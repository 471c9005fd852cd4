"""The live queue against a real ``prefect server start``: ``e31 scheduler``
and ``e31 worker`` processes (each worker its own scratch, told its node's
GPUs with E31_NODE_GPUS: this machine has none), jobs submitted with
``e31 submit``.  The works are small commands that record what they saw."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests import hold
from tests.conftest import final_manifest, place_by_hand, stop_group

WORK = textwrap.dedent("""
    import json, os, pathlib, sys, time
    out = pathlib.Path(os.environ["E31_OUTPUT_DIR"])
    record = {"devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "node": os.environ.get("E31_NODE"),
              "start": time.time(), "pid": os.getpid()}
    (out / "started.json").write_text(json.dumps(record))
    time.sleep(float(sys.argv[1]))
    record["end"] = time.time()
    (out / "record.json").write_text(json.dumps(record))
""")


class Queue:
    """A pool on the session's Prefect server with its scheduler and workers."""

    def __init__(self, root: Path, nodes: dict[str, int]):
        self.root, self.name = root, f"q{uuid.uuid4().hex[:8]}"
        self.pool = root / "pool.yaml"
        self.pool.write_text(json.dumps({"pool_version": 1, "name": self.name, "nodes": [
            {"name": n, "gpus": g, "cpus": 2, "memory": "1GiB"} for n, g in nodes.items()]}))
        (root / "work.py").write_text(WORK)
        self.procs: dict[str, subprocess.Popen] = {}
        self.exe = str(Path(sys.executable).with_name("e31"))

    def start(self, what: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        log = open(self.root / f"{what}.log", "wb")
        proc = subprocess.Popen([self.exe, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})}, cwd=self.root)
        self.procs[what] = proc
        return proc

    def scheduler(self, *extra: str) -> None:
        self.start("scheduler", "scheduler", "--pool", str(self.pool), "--interval", "0.5", *extra)

    def worker(self, node: str, gpus: int, env: dict | None = None) -> subprocess.Popen:
        return self.start(f"worker-{node}", "worker", "--pool", str(self.pool), "--node", node,
                          env={"E31_NODE_GPUS": str(gpus), "E31_SCRATCH": str(self.root / f"scratch-{node}"),
                               **(env or {})})

    def job(self, name: str, gpus: int, seconds: float, work: str = "work.py", data: list | None = None,
            **request) -> Path:
        spec = self.root / f"{name}.yaml"
        spec.write_text(json.dumps({
            "name": name, "work": {"kind": "simulation", "command": [sys.executable, work, str(seconds)]},
            "data": data or [],
            "request": {"gpus": gpus, "cpus": 1, "duration": f"{seconds + 5}s", "limit": "5m", **request},
            "output": {"kind": "results", "url": str(self.root / "out" / name), "files": ["record.json"]}}))
        return spec

    def submit(self, spec: Path, *args: str) -> str:
        done = subprocess.run([self.exe, "submit", str(spec), "--pool", str(self.pool), *args], capture_output=True,
                              text=True, cwd=self.root)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def record(self, name: str) -> dict:
        return json.loads((self.root / "out" / name / "record.json").read_text())

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                stop_group(proc, timeout=20)


@contextmanager
def queue(tmp_path: Path, nodes: dict[str, int]):
    q = Queue(tmp_path, nodes)
    try:
        yield q
    except BaseException:  # a failure's report shows what the scheduler and the workers said
        for log in sorted(tmp_path.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-6000:]}")
        print(f"--- flow runs\n{_states()}")
        raise
    finally:
        q.stop()


def wait_for(predicate, timeout: float = 180.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout:g} s; flow runs: {_states()}")
        time.sleep(0.3)


def _states() -> list[tuple]:
    """(name, state type, state name, message, placement) of the server's flow runs (for a failure's message)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return [(r.name, r.state.type.value, r.state.name, (r.state.message or "")[:120],
                 (r.parameters or {}).get("placement")) for r in client.read_flow_runs(limit=50)]


def _done(q: Queue, *names: str) -> bool:
    return all(final_manifest(q.root / "out" / n) for n in names)


def test_gpu_jobs_share_a_node_without_overlap_and_see_only_their_devices(prefect_api, tmp_path):
    with queue(tmp_path, {"n1": 8}) as q:
        q.scheduler()
        q.worker("n1", 8)
        for job in (q.job("six-a", 6, 20), q.job("six-b", 6, 20), q.job("two", 2, 30)):
            q.submit(job)
        wait_for(lambda: _done(q, "six-a", "six-b", "two"), timeout=240, what="three jobs")
        a, b, two = q.record("six-a"), q.record("six-b"), q.record("two")

    def overlap(x: dict, y: dict) -> bool:
        return x["start"] < y["end"] and y["start"] < x["end"]

    assert not overlap(a, b)  # the two 6-GPU jobs never overlap on the 8-GPU node
    assert overlap(two, a) or overlap(two, b)  # the 2-GPU job ran beside a 6-GPU one
    assert a["devices"] == b["devices"] == "0,1,2,3,4,5" and two["devices"] == "6,7"  # disjoint
    assert {a["node"], b["node"], two["node"]} == {"n1"}


def test_a_deadline_job_goes_before_a_long_job_that_has_slack(prefect_api, tmp_path):
    from datetime import datetime, timedelta, timezone

    with queue(tmp_path, {"n1": 4}) as q:
        q.scheduler()
        q.worker("n1", 4)
        q.submit(q.job("busy", 4, 25))  # long enough for both submissions to land while it runs, even under load
        wait_for(lambda: (q.root / "out").exists() and any((q.root / "scratch-n1").glob("busy/output/started.json")),
                 what="the first job to start")
        q.submit(q.job("long", 4, 30))
        # must stop 30 s before its deadline: only if it goes before long (which would end ~55 s from now)
        deadline = (datetime.now(timezone.utc) + timedelta(seconds=80)).isoformat()
        q.submit(q.job("urgent", 4, 5, deadline=deadline))
        assert not _done(q, "busy")
        wait_for(lambda: _done(q, "busy", "long", "urgent"), timeout=240, what="three jobs")
        busy, long, urgent = q.record("busy"), q.record("long"), q.record("urgent")
    assert busy["end"] <= urgent["start"] < long["start"]
    assert urgent["end"] <= datetime.fromisoformat(deadline).timestamp()


def test_refusals_end_with_their_reason_and_a_failed_manifest(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client

    with queue(tmp_path, {"n1": 8}) as q:
        q.scheduler()
        out = q.submit(q.job("too-big", 9, 1))
        assert ("refused: no node can hold 9 GPUs: the largest nodes have 8 GPUs: ask for at most 8 GPUs "
                "(request.gpus), or add a larger node to the pool file") in out
        run_id = out.split("flow run ")[1].split()[0]
        with get_client(sync_client=True) as client:
            wait_for(lambda: client.read_flow_run(run_id).state.is_final(), what="the refusal")
            state = client.read_flow_run(run_id).state
    assert (state.type.value, state.message) == ("FAILED", "refused: no node can hold 9 GPUs: the largest nodes "
                                                           "have 8 GPUs: ask for at most 8 GPUs (request.gpus), or add a larger node to the pool file")
    manifest = json.loads((tmp_path / "out" / "too-big" / "partial" / "manifest.json").read_text())
    assert (manifest["status"], manifest["files"]) == ("failed", [])
    assert manifest["message"] == ("refused by the queue: no node can hold 9 GPUs: the largest nodes have 8 GPUs"
                                   ": ask for at most 8 GPUs (request.gpus), or add a larger node to the pool file")


def test_a_job_whose_destination_cannot_be_made_fails_in_one_line_without_a_traceback(prefect_api, tmp_path):
    """A queued job whose ``output.url`` lies under a file passes e31 submit
    and fails on its node; it must not fail with Prefect's engine traceback
    (~45 lines) after E31's one line, in the worker's output and the run's
    log.  The one line, with the fix, is all: in the state
    message, the run's log in the Prefect UI, and the worker's output."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    (tmp_path / "afile").write_text("x")
    with queue(tmp_path, {"n1": 0}) as q:
        q.scheduler()
        q.worker("n1", 0)
        spec = json.loads(q.job("nowhere", 0, 1).read_text())
        spec["output"]["url"] = str(tmp_path / "afile" / "out")
        (q.root / "nowhere.yaml").write_text(json.dumps(spec))
        run_id = q.submit(q.root / "nowhere.yaml").split("flow run ")[1].split()[0]
        with get_client(sync_client=True) as client:
            wait_for(lambda: client.read_flow_run(run_id).state.is_final(), timeout=120, what="its end")
            state = client.read_flow_run(run_id).state
            time.sleep(3)  # its last log lines, sent at its end
            logged = [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(
                any_=[run_id])))]
        worker_log = (q.root / "worker-n1.log").read_text()
    said = (f"output.url: {tmp_path}/afile/out: cannot create it (Not a directory): give a folder this user can "
            "create, of the job's own, e.g. ~/results/NAME/")
    assert (state.type.value, state.message) == ("FAILED", said)
    assert said in logged and said in worker_log
    assert not [m for m in logged if "unexpected exception" in m or "Traceback" in m]
    assert "Traceback" not in worker_log and "unexpected exception" not in worker_log


def test_a_waiting_job_says_why_in_its_state_and_in_e31_queue(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client

    with queue(tmp_path, {"n1": 8}) as q:
        q.scheduler("--handover", "0")  # the waiter stays queued (else handed over 10 s before the holder's end)
        q.worker("n1", 8)
        # the holder runs far longer than the test: it still holds n1 when e31 queue lists it on a loaded machine
        first = q.submit(q.job("holder", 8, 200)).split("flow run ")[1].split()[0]
        wait_for(lambda: any((q.root / "scratch-n1").glob("holder/output/started.json")), what="the holder")
        waiting = q.submit(q.job("waiter", 6, 1)).split("flow run ")[1].split()[0]
        with get_client(sync_client=True) as client:
            wait_for(lambda: (client.read_flow_run(waiting).state.message or "").startswith("Queued: waiting for 6 GPUs"),
                     what="the reason")
            state = client.read_flow_run(waiting).state
        listed = subprocess.run([q.exe, "queue", "--pool", str(q.pool)], capture_output=True, text=True, cwd=q.root)
    reason = state.message.removeprefix("Queued: ")
    assert state.name == "Queued"
    assert reason.startswith("waiting for 6 GPUs on one node (0 free on n1); earliest start ")
    assert reason.endswith(f" UTC on n1, after job holder ({first[:8]}) ends")
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["JOB", "RUN", "STATE", "NODE", "GPUS", "START", "REASON"]
    assert lines[1].split()[:5] == ["holder", first[:8], "Running", "n1", "0,1,2,3,4,5,6,7"]
    assert lines[1].endswith("running")
    assert lines[2].split()[:5] == ["waiter", waiting[:8], "Queued", "n1", "0,1,2,3,4,5"]
    assert lines[2].endswith(reason.split("; earliest")[0] + "; earliest" + reason.split("; earliest")[1]) \
        or "waiting for 6 GPUs on one node (0 free on n1)" in lines[2]


STEPS = textwrap.dedent("""
    import json, os, pathlib, sys, time
    out, ck = pathlib.Path(os.environ["E31_OUTPUT_DIR"]), pathlib.Path(os.environ["E31_CHECKPOINT_DIR"])
    resume = os.environ.get("E31_RESUME_DIR") or ""
    start = int(pathlib.Path(resume, "step").read_text()) if resume else 0
    (out / "attempts.txt").open("a").write(f"{start} {os.getpid()} {os.environ.get('E31_NODE')} {time.time()}\\n")
    for step in range(start + 1, int(float(sys.argv[1])) + 1):
        time.sleep(0.5)
        folder = ck / f"step-{step}"
        folder.mkdir()
        (folder / "step").write_text(str(step))
        (folder / "COMMITTED").write_text("")
    (out / "record.json").write_text(json.dumps({"resumed_from": start, "node": os.environ.get("E31_NODE")}))
""")


def _durable_step(durable: Path) -> int:
    """The newest step whose checkpoint is durable at the destination (0: none
    yet); older ones are removed as newer ones land, so a poll may miss one."""
    return max((int(p.parent.name.split("-")[1]) for p in durable.glob("step-*/COMMITTED")), default=0)


def _flow_process(q: Queue, name: str, node: str) -> int:
    """The pid of the flow process running job ``name``'s work on ``node``
    (the work's parent: its supervisor)."""
    line = (q.root / f"scratch-{node}" / name / "output" / "attempts.txt").read_text().splitlines()[-1]
    work = int(line.split()[1])
    return int(Path(f"/proc/{work}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _warm_processes(worker: subprocess.Popen) -> list[int]:
    """The pids of the worker's warm flow processes (its children running e31.deployments.warmstart)."""
    kids, found = Path(f"/proc/{worker.pid}/task/{worker.pid}/children").read_text().split(), []
    for kid in kids:
        try:
            if b"e31.deployments.warmstart" in Path(f"/proc/{kid}/cmdline").read_bytes():  # a zombie's is empty
                found.append(int(kid))
        except OSError:  # ended and reaped since the list was read
            pass
    return found


def _warm_listening(worker: subprocess.Popen) -> bool:
    """Whether the worker's warm process listens on its socket (its argument after the module's name):
    runs started before start cold, and with event wakeups a job submitted at once can come first."""
    for kid in _warm_processes(worker):
        try:
            args = Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")
            if Path(args[args.index(b"e31.deployments.warmstart") + 1].decode()).exists():
                return True
        except (OSError, IndexError, ValueError):  # ended since it was listed (a zombie's command line is empty)
            pass
    return False


def test_a_killed_flow_process_frees_its_node_and_a_retried_job_resumes(prefect_api, tmp_path):
    with queue(tmp_path, {"n1": 8}) as q:
        (q.root / "steps.py").write_text(STEPS)
        q.scheduler()
        worker = q.worker("n1", 8)
        wait_for(lambda: _warm_listening(worker), what="the worker's warm process")
        q.submit(q.job("resumer", 8, 30, work="steps.py", retries=1))
        q.submit(q.job("next", 8, 1))
        durable = q.root / "out" / "resumer" / "checkpoints"
        wait_for(lambda: _durable_step(durable) >= 3, what="three durable steps")
        flow = _flow_process(q, "resumer", "n1")
        warm = Path(f"/proc/{flow}/stat").read_text().rsplit(")", 1)[1].split()[1]
        assert b"e31.deployments.warmstart" in Path(f"/proc/{warm}/cmdline").read_bytes()  # forked, warm
        os.kill(flow, signal.SIGKILL)  # the flow process, not the worker nor its client
        wait_for(lambda: _done(q, "resumer", "next"), timeout=300, what="both jobs")
        record = q.record("resumer")
    assert record["resumed_from"] >= 3  # the retry resumed from its newest durable checkpoint
    assert json.loads((q.root / "out" / "resumer" / "manifest.json").read_text())["status"] == "completed"


def test_a_lost_node_s_jobs_resume_elsewhere_once_it_is_declared_down(prefect_api, tmp_path):
    """The machine n1 gone (its worker and every process it started
    killed) while a job with a retry runs there: past the lease n1 is
    taken for lost and fenced, and the job, queued again, waits for the
    fence (a silent machine promises nothing: its work may still run).
    ``e31 node n1 --down`` (the operator: the machine is off) releases it:
    it starts on n2 within a tick and a worker's poll, resuming from its
    newest durable checkpoint."""
    with queue(tmp_path, {"n1": 4, "n2": 4}) as q:
        (q.root / "steps.py").write_text(STEPS)
        q.scheduler("--lease", "25")
        doomed = q.worker("n1", 4)
        run_id = q.submit(q.job("survivor", 4, 40, work="steps.py", retries=1)).split("flow run ")[1].split()[0]
        durable = q.root / "out" / "survivor" / "checkpoints"
        wait_for(lambda: _durable_step(durable) >= 3, what="three durable steps on n1")
        os.killpg(doomed.pid, signal.SIGKILL)  # the worker and everything it started: the machine is gone
        flow = _flow_process(q, "survivor", "n1")
        try:
            os.kill(flow, signal.SIGKILL)
        except ProcessLookupError:
            pass
        q.worker("n2", 4)
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            wait_for(lambda: (client.read_flow_run(run_id).state.message or "").startswith(
                "Queued: waiting for its attempt on node n1, lost while it ran, to be confirmed ended"), timeout=180,
                what="the job queued again, waiting for n1's fence")
        assert not (q.root / "scratch-n2" / "survivor" / "output" / "attempts.txt").exists()
        down_at = time.monotonic()
        done = subprocess.run([q.exe, "node", "n1", "--pool", str(q.pool), "--down"], capture_output=True, text=True,
                              cwd=q.root)
        assert done.returncode == 0 and done.stdout.startswith("node n1: declared down: "), done
        wait_for(lambda: (q.root / "scratch-n2" / "survivor" / "output" / "attempts.txt").exists(), timeout=120,
                 what="the job to start again on n2")
        released_s = time.monotonic() - down_at
        wait_for(lambda: _done(q, "survivor"), timeout=240, what="the job")
        record = q.record("survivor")
    assert released_s < 60  # a scheduler tick, a worker's poll, a process start on a loaded machine
    assert record["node"] == "n2" and record["resumed_from"] >= 3


def test_cancel_takes_a_queued_job_out_and_stops_a_running_one(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client

    with queue(tmp_path, {"n1": 8}) as q:
        q.scheduler()
        q.worker("n1", 8)
        running = q.submit(q.job("long-one", 8, 120)).split("flow run ")[1].split()[0]
        wait_for(lambda: any((q.root / "scratch-n1").glob("long-one/output/started.json")), what="the first job")
        # submitted once the first runs: in one tick with it, the shorter job goes first (and ends before its cancel)
        queued = q.submit(q.job("never", 8, 1)).split("flow run ")[1].split()[0]
        out = subprocess.run([q.exe, "cancel", "never", "--pool", str(q.pool)], capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout == f"cancelled never ({queued}): removed from the queue\n"
        out = subprocess.run([q.exe, "cancel", running[:8], "--pool", str(q.pool)], capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.startswith(
            f"cancelling long-one ({running}): its work is stopped (or never starts, if it has not yet)")
        with get_client(sync_client=True) as client:
            wait_for(lambda: client.read_flow_run(running).state.is_final(), timeout=120, what="the cancel")
            states = [client.read_flow_run(r).state.type.value for r in (running, queued)]
            said = [s.message for s in client.read_flow_run_states(running) if s.type.value == "CANCELLED"]
        # a job that ended: what its last run was (not only "no queued or running job")
        again = [subprocess.run([q.exe, "cancel", what, "--pool", str(q.pool)], capture_output=True, text=True)
                 for what in ("never", running, "ghost", queued[:8])]
    assert states == ["CANCELLED", "CANCELLED"]
    assert [a.returncode for a in again] == [1, 1, 1, 1] and [a.stdout for a in again] == ["", "", "", ""]
    clock = r"\d\d:\d\d(:\d\d)? UTC"
    assert re.fullmatch(rf"e31: cancel: no queued or running job 'never' in pool {q.name}: its last run "
                        rf"\({queued[:8]}\) ended Cancelled at {clock}: nothing to cancel\n", again[0].stderr), again[0]
    assert re.fullmatch(rf"e31: cancel: no queued or running job '{running}' in pool {q.name}: the run "
                        rf"\({running[:8]}\) ended Cancelled at {clock}: nothing to cancel\n", again[1].stderr), again[1]
    assert again[2].stderr == (f"e31: cancel: no queued or running job 'ghost' in pool {q.name}: no run of 'ghost' in "
                               f"pool {q.name}; e31 queue lists its queued and running jobs\n")
    assert re.fullmatch(rf"e31: cancel: no queued or running job '{queued[:8]}' in pool {q.name}: the run "
                        rf"\({queued[:8]}\) ended Cancelled at {clock}: nothing to cancel\n", again[3].stderr), again[3]
    ghost = subprocess.run([q.exe, "cancel", "0123abcd", "--pool", str(q.pool)], capture_output=True, text=True)
    assert ghost.stderr == (f"e31: cancel: no queued or running job '0123abcd' in pool {q.name}: no run of '0123abcd' "
                            f"in pool {q.name} (a run id's first characters are looked up among the 200 runs that "
                            "ended last); e31 queue lists its queued and running jobs\n")
    manifest = json.loads((tmp_path / "out" / "long-one" / "partial" / "manifest.json").read_text())
    assert (manifest["status"], manifest["reason"]) == ("partial", "cancelled")
    # the cancel hook runs in the worker (Prefect's cancellation: kill, hooks, then its own Cancelled message): it
    # reads this run's manifest at the destination (it said "no manifest was written", from the worker's memory)
    assert said[0] == (f"cancelled: E31 stopped the work and returned what it had, partial: {len(manifest['files'])} "
                       "file(s) in partial/ at the destination (see the manifest there)"), said
    assert not (tmp_path / "out" / "never").exists()


def test_a_resubmitted_job_goes_where_its_inputs_are_staged(prefect_api, tmp_path):
    with queue(tmp_path, {"n1": 2, "n2": 2}) as q:
        big = q.root / "input.bin"
        big.write_bytes(os.urandom(2**20))
        data = [{"name": "inp", "url": str(big)}]
        q.scheduler()
        q.worker("n2", 2)  # only n2 for the first run
        q.submit(q.job("local", 1, 1, data=data))
        wait_for(lambda: _done(q, "local"), what="the first run")
        assert q.record("local")["node"] == "n2"
        (q.root / "out" / "local" / "manifest.json").unlink()
        q.worker("n1", 2)
        time.sleep(3)  # both workers heart-beating
        q.submit(q.job("local", 1, 1, data=data))
        wait_for(lambda: _done(q, "local"), what="the second run")
        manifest = json.loads((q.root / "out" / "local" / "manifest.json").read_text())
    assert q.record("local")["node"] == "n2"
    assert manifest["status"] == "completed"
    assert not (q.root / "scratch-n1" / "local").exists()  # nothing staged on n1


def test_runs_of_a_deployment_on_the_pool_go_through_the_queue(prefect_api, tmp_path):
    """`e31 deploy --pool` onto the queue's work pool (given the pool file,
    as the queue's other commands take it, not only the work pool's name,
    which said "Work pool "pool.yaml" not found"): each
    run of the deployment (a cron schedule's, or one started by hand) joins
    the queue when its time comes and is placed like a submitted job."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    with queue(tmp_path, {"n1": 2}) as q:
        q.scheduler()
        q.worker("n1", 2)
        with get_client(sync_client=True) as client:
            wait_for(lambda: _pool_exists(client, q.name), what="the work pool")
        spec = q.job("deployed", 2, 1)
        done = subprocess.run([q.exe, "deploy", str(spec), "--pool", str(q.pool)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert f") on pool {q.name} for tenant default, no schedule" in done.stdout
        run = run_deployment("e31-job/deployed", timeout=0)
        wait_for(lambda: _done(q, "deployed"), what="the deployed run")
        record = q.record("deployed")
        with get_client(sync_client=True) as client:  # the flow run's state is set after its manifest is written
            wait_for(lambda: client.read_flow_run(run.id).state.is_final(), what="the run's final state")
            final = client.read_flow_run(run.id)
    assert record["node"] == "n1" and record["devices"] == "0,1"
    assert final.state.type.value == "COMPLETED" and final.parameters["placement"]["e31_node"] == "n1"


def _pool_exists(client, name: str) -> bool:
    from prefect.exceptions import ObjectNotFound

    try:
        client.read_work_pool(name)
        return True
    except ObjectNotFound:
        return False


def test_e31_queue_lists_a_second_run_of_a_job_and_why_it_waits(prefect_api, tmp_path):
    """A job submitted again while its first run waits is listed by `e31
    queue`, with why it waits (one run of a job at a time); it was missing."""
    with queue(tmp_path, {"n1": 0}) as q:
        spec = q.job("again", 0, 1)
        first = q.submit(spec).split("flow run ")[1].split()[0]
        second = q.submit(spec).split("flow run ")[1].split()[0]
        listed = subprocess.run([q.exe, "queue", "--pool", str(q.pool)], capture_output=True, text=True, cwd=q.root)
    lines = listed.stdout.split("\n\n")[0].splitlines()
    assert [line.split()[:3] for line in lines[1:]] == [["again", first[:8], "Queued"], ["again", second[:8], "Queued"]]
    assert lines[2].endswith(f"waiting for the run again ({first[:8]}) of this job, queued ahead, to end: one run of "
                             "a job at a time")


ANCESTRY = textwrap.dedent("""
    import json, os, pathlib
    parent = lambda pid: int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    flow = parent(os.getpid())  # the work's parent: its flow process
    above = pathlib.Path(f"/proc/{parent(flow)}/cmdline").read_bytes().decode().split("\\0")
    (pathlib.Path(os.environ["E31_OUTPUT_DIR"]) / "record.json").write_text(json.dumps({"above_flow": above}))
""")


def test_a_run_placed_before_the_warm_process_listens_waits_for_it_and_starts_warm(prefect_api, tmp_path):
    """The job is queued before its node's worker starts, so it is placed
    as soon as the worker is heard from: the worker is first heard from
    once its warm process listens (and takes no run before), and the run
    is forked from it.  It used to be placed while the warm process was
    still importing and started cold, beside those imports: 13-15 s to
    ``Running`` on two busy cores, against about 1 s warm."""
    with queue(tmp_path, {"n1": 8}) as q:
        (q.root / "ancestry.py").write_text(ANCESTRY)
        q.scheduler()
        q.submit(q.job("early", 0, 1, work="ancestry.py"))  # queued: no worker yet
        q.worker("n1", 8)
        wait_for(lambda: _done(q, "early"), timeout=240, what="the job")
        above = q.record("early")["above_flow"]
        assert above[1:3] == ["-m", "e31.deployments.warmstart"], above  # cold: the worker's own command line


def test_a_worker_started_for_a_node_with_runs_is_heard_from_before_its_warm_process_listens(prefect_api, tmp_path):
    """The first heartbeat must not wait for the warm process (up to 60 s):
    a worker started again after a kill, with a warm process slow or stuck
    at import, let the lease run out, its node taken for lost and its
    running jobs crashed.  With a run holding the
    node, the worker is heard from at once; its warm process here never
    listens (an import that hangs), and is killed when the worker stops."""
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    with queue(tmp_path, {"n1": 8}) as q:
        shadow = q.root / "shadow"
        shadow.mkdir()
        (shadow / "s3fs.py").write_text("import time\ntime.sleep(3600)\n")  # the warm process preloads s3fs
        held = q.submit(q.job("held", 8, 1)).split("flow run ")[1].split()[0]  # no scheduler: stays queued
        with get_client(sync_client=True) as client:
            place_by_hand(client, held, "n1", range(8))
            client.set_flow_run_state(held, Running(), force=True)  # as a killed worker's run is left
            worker = q.start("worker-n1", "worker", "--pool", str(q.pool), "--node", "n1", env={
                "E31_NODE_GPUS": "8", "E31_SCRATCH": str(q.root / "scratch-n1"),
                "PYTHONPATH": os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH")) if p)})
            beat = lambda: [w for w in client.read_workers_for_work_pool(q.name) if w.name == "n1"]  # noqa: E731
            wait_for(beat, timeout=45, what="the worker's first heartbeat (it came after 60 s)")
            warm = _warm_processes(worker)
            assert len(warm) == 1 and not _warm_listening(worker)  # stuck at import, and the node is live anyway
            # its setup ends with the orphan check (the held run has no flow process here): stopped before, there
            # is no teardown, and the setup kills the warm process itself (as it can under load)
            wait_for(lambda: client.read_flow_run(held).state.type.value == "CRASHED", what="the orphan check")
        q.stop()
        wait_for(lambda: not Path(f"/proc/{warm[0]}").exists() or b"Z" in
                 Path(f"/proc/{warm[0]}/stat").read_bytes().rsplit(b")", 1)[1][:3], timeout=60,
                 what="the stuck warm process to be killed with its worker")


def test_a_worker_starts_a_new_warm_process_when_its_own_dies(prefect_api, tmp_path):
    warm = _warm_processes
    with queue(tmp_path, {"n1": 1}) as q:
        worker = q.worker("n1", 1)
        wait_for(lambda: len(warm(worker)) == 1, what="the worker's warm process")
        (first,) = warm(worker)
        os.kill(first, signal.SIGKILL)
        # one look per check: the killed one can still be listed at one look and gone (a zombie) at the next
        wait_for(lambda: (seen := warm(worker)) and len(seen) == 1 and seen != [first], timeout=90,
                 what="a new warm process")
        second = warm(worker)
        assert len(second) == 1 and second != [first], (first, second)
        q.scheduler()
        q.submit(q.job("after-warm", 1, 1))
        wait_for(lambda: _done(q, "after-warm"), what="a job after the restart")
        log = (q.root / "worker-n1.log").read_text()
        assert "the warm flow process ended (exit status -9); starting another" in log, (first, second, log)


def test_the_scheduler_and_the_worker_wake_on_the_server_s_events(prefect_api, tmp_path):
    """With ticks and worker polls 600 s apart, jobs still start within
    seconds: a submission's ``Queued`` event wakes the scheduler, the
    scheduler's announcement of the placement, naming the node, the worker
    (e31.deployments.runevents, e31.flows.queue.announce)."""
    import httpx
    from prefect.client.orchestration import get_client

    with queue(tmp_path, {"n1": 0}) as q:
        q.scheduler("--interval", "600")  # the last --interval wins
        q.start("worker-n1", "worker", "--pool", str(q.pool), "--node", "n1",
                env={"E31_NODE_GPUS": "0", "E31_SCRATCH": str(q.root / "scratch-n1"),
                     "PREFECT_WORKER_QUERY_SECONDS": "600"})
        with get_client(sync_client=True) as client:  # a worker coming live is seen at the next tick, 600 s away
            wait_for(lambda: _pool_exists(client, q.name) and any(
                w.name == "n1" for w in client.read_workers_for_work_pool(q.name)), what="the worker's first heartbeat")
        q.submit(q.job("first", 0, 1))  # placed by the tick its Queued event wakes; started by the Placed event
        wait_for(lambda: _done(q, "first"), timeout=150, what="the first job")
        submitted = time.time()
        run_id = q.submit(q.job("second", 0, 1)).split("flow run ")[1].split()[0]
        wait_for(lambda: _done(q, "second"), timeout=150, what="the second job, by events alone")
        with get_client(sync_client=True) as client:
            wait_for(lambda: client.read_flow_run(run_id).state.is_final(), what="the second run's final state")
            states = [(s.type.value, s.name) for s in client.read_flow_run_states(run_id)]
            # written beside the run's start, not before it; a busy database's 503 is left to Prefect's retries
            # (2, 4, 8... s: busy.UNHURRIED), so they may come after the run's end
            wait_for(lambda: "prefect.worker.name" in client.read_flow_run(run_id).labels, timeout=90,
                     what="the worker's labels on the run")
            labels = client.read_flow_run(run_id).labels

        def announced() -> list[dict]:  # the server keeps the events it streamed (its persister: a few seconds)
            answer = httpx.post(f"{prefect_api}/events/filter", json={"filter": {
                "event": {"name": ["e31.flow-run.placed"]}, "resource": {"id": [f"prefect.flow-run.{run_id}"]},
                "occurred": {"since": "2020-01-01T00:00:00Z"}}}, timeout=30)
            answer.raise_for_status()
            return answer.json()["events"]

        wait_for(announced, timeout=60, what="the placement's announcement among the server's events")
        events = announced()
    assert [(e["resource"]["prefect.resource.id"], e["resource"]["e31.node"]) for e in events] == [
        (f"prefect.flow-run.{run_id}", "n1")]
    assert any(r["prefect.resource.role"] == "work-pool" for r in events[0]["related"])
    assert ("SCHEDULED", "Placed") in states and states[-1] == ("COMPLETED", "Completed")
    assert (labels["prefect.worker.name"], labels["prefect.worker.type"]) == ("n1", "e31")
    # both the next tick and the next poll were 600 s away when it was submitted
    assert q.record("second")["end"] - submitted < 300


def test_ctrl_c_of_a_worker_returns_its_running_job_s_output_before_it_exits(prefect_api, tmp_path):
    """SIGINT to the worker's process group (a Ctrl-C in its terminal, which
    the flow processes' clients get too): the worker takes no new job, its
    running job stops and returns its output marked partial, its flow run
    ends, and only then does the worker exit."""
    from prefect.client.orchestration import get_client

    with queue(tmp_path, {"n1": 0}) as q:
        q.scheduler()
        worker = q.worker("n1", 0)
        running = q.submit(q.job("long-one", 0, 120, cpus=2)).split("flow run ")[1].split()[0]  # the whole node
        wait_for(lambda: any((q.root / "scratch-n1").glob("long-one/output/started.json")), what="the job's work")
        waiting = q.submit(q.job("after", 0, 1, cpus=2)).split("flow run ")[1].split()[0]
        os.killpg(worker.pid, signal.SIGINT)
        worker.wait(timeout=120)
        manifest = final_manifest(tmp_path / "out" / "long-one" / "partial")  # returned before the worker exited
        with get_client(sync_client=True) as client:
            ended = client.read_flow_run(running).state
            after = client.read_flow_run(waiting).state
        log = (q.root / "worker-n1.log").read_text()
    assert worker.returncode == 0
    assert (manifest["status"], manifest["reason"]) == ("partial", "signal")
    assert (ended.type.value, ended.name) == ("COMPLETED", "Partial")
    assert (after.type.value, after.name) == ("SCHEDULED", "Queued") or after.name == "Placed"  # never taken
    assert not (tmp_path / "out" / "after").exists()
    assert ("e31 worker: stopping: no new job is taken; 1 running job(s) told to stop and return their output "
            "(waiting up to 300 s; send the signal again to stop now)") in log


def _kill_worker_and_run(worker: subprocess.Popen, run_id: str) -> list[int]:
    """kill -9 of a worker (its process group: it and its flow processes' clients), then of every process
    whose environment names the flow run ``run_id`` (the fork of the warm process, the work's processes);
    returns the latter's pids."""
    run_procs = [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/environ") if _has_env(
        p, f"PREFECT__FLOW_RUN_ID={run_id}")]
    os.killpg(worker.pid, signal.SIGKILL)
    for pid in run_procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    worker.wait()
    return run_procs


def _has_env(environ: Path, entry: str) -> bool:
    try:
        return entry.encode() in environ.read_bytes().split(b"\0")
    except OSError:
        return False


def test_a_worker_started_again_frees_the_runs_its_predecessor_left_without_a_process(prefect_api, tmp_path):
    """kill -9 of a worker and of its flow process, and a new worker for the
    node at once (well within the lease, which its heartbeats then keep
    from ever running out): the run left ``Running`` is marked ``Crashed`` by
    the new worker, the node is free again, and the next job runs."""
    from prefect.client.orchestration import get_client

    with queue(tmp_path, {"n1": 0}) as q:
        q.scheduler()
        worker = q.worker("n1", 0)
        lost = q.submit(q.job("orphan", 0, 120, cpus=2)).split("flow run ")[1].split()[0]
        wait_for(lambda: any((q.root / "scratch-n1").glob("orphan/output/started.json")), what="the job's work")
        q.submit(q.job("next-one", 0, 1, cpus=2))
        assert _kill_worker_and_run(worker, lost)
        q.start("worker-n1-again", "worker", "--pool", str(q.pool), "--node", "n1",  # its own log: the first
                env={"E31_NODE_GPUS": "0", "E31_SCRATCH": str(q.root / "scratch-n1")})  # worker's is kept
        wait_for(lambda: _done(q, "next-one"), timeout=120, what="the next job, on the freed node")
        assert final_manifest(q.root / "out" / "next-one")["status"] == "completed", \
            final_manifest(q.root / "out" / "next-one")
        with get_client(sync_client=True) as client:
            states = [(s.type.value, s.message) for s in client.read_flow_run_states(lost)]
        assert states[-1] == ("CRASHED", "its flow process is gone: node n1's e31 worker started again and found no "
                                         "process for it on this machine; its resources are free again"), states
        assert "had no flow process left on this machine: marked Crashed" in \
            (q.root / "worker-n1-again.log").read_text()


@pytest.mark.parametrize("again", [1, 2], ids=["one-worker", "two-workers"])
def test_a_return_cut_with_its_worker_killed_too_is_finished_by_the_worker_started_again(prefect_api, tmp_path,
                                                                                         again):
    """kill -9 of a worker, then of its job's flow process, in the middle of
    the job's return: no worker saw the flow process end.  The worker started
    again on the node finds the run with no flow process and its return cut
    in the job's scratch: it holds the run ``Pending`` (``Returning``, the
    node still its own) and finishes the return.  Before, it marked the run
    ``Crashed`` and the output waited in scratch for ``e31 return JOB``.
    Two workers started at once for the node: one finishes it,
    the other leaves it to that one (it used to crash it, and a retry then
    ran the work again)."""
    from prefect.client.orchestration import get_client

    with queue(tmp_path, {"n1": 0}) as q:
        (q.root / "blobs.py").write_text(BLOBS)
        q.scheduler()
        worker = q.worker("n1", 0, env=hold.env("returning", q.root / "held"))
        wait_for(lambda: _warm_listening(worker), what="n1's warm process")
        run_id = q.submit(q.job("cut", 0, BLOB_COUNT, work="blobs.py", cpus=2, duration="1m")).split("flow run ")[1].split()[0]
        out = q.root / "out" / "cut"
        flow_pid = _held_returning(q, out)
        _kill_worker_and_run(worker, run_id)  # the worker first: it does not see its flow process end
        os.kill(flow_pid, signal.SIGKILL)  # a fork of the warm process: its environment does not name the run
        wait_for(lambda: _gone(flow_pid), timeout=30, what="the held flow process's end")
        assert final_manifest(out) is None and list((q.root / "scratch-n1").rglob("return-pending.json"))
        for k in range(again):
            q.start(f"worker-n1-again-{k}", "worker", "--pool", str(q.pool), "--node", "n1",
                    env={"E31_NODE_GPUS": "0", "E31_SCRATCH": str(q.root / "scratch-n1")})
        wait_for(lambda: final_manifest(out) is not None, timeout=120, what="the return to be finished")
        with get_client(sync_client=True) as client:
            wait_for(lambda: client.read_flow_run(run_id).state.is_final(), what="its final state")
            time.sleep(3)  # a second worker's late state write, if any, comes within its start
            history = client.read_flow_run_states(run_id)
    states = [(s.type.value, s.name) for s in history]
    said = [(s.name, s.message) for s in history]  # who wrote what, when an assertion fails
    manifest = final_manifest(out)
    assert (manifest["status"], manifest["run_id"]) == ("completed", run_id)
    assert sorted(f["path"] for f in manifest["files"]) == [f"blob-{i:03d}.bin" for i in range(BLOB_COUNT)] + ["record.json"]
    assert all(f["sha256"] == _sha256(out / f["path"]) for f in manifest["files"])
    assert list((q.root / "scratch-n1").rglob("return-pending.json")) == []
    after = states[[s[0] for s in states].index("RUNNING") + 1:]
    logs = [(q.root / f"worker-n1-again-{k}.log").read_text() for k in range(again)]
    assert after[-1] == ("COMPLETED", "Completed") and set(after[:-1]) == {("PENDING", "Returning")}, (said, logs)
    assert sum(f"flow run {run_id} (cut) was cut in the middle of the return of its output: finishing it" in log
               for log in logs) >= 1, logs


PRINTS = textwrap.dedent("""
    import json, os, pathlib, sys, time
    out = pathlib.Path(os.environ["E31_OUTPUT_DIR"])
    (out / "started.json").write_text(json.dumps({"pid": os.getpid()}))
    for i in range(int(float(sys.argv[1]))):
        print(f"line {i}", flush=True)
        time.sleep(0.5)
    (out / "record.json").write_text(json.dumps({"lines": int(float(sys.argv[1]))}))
""")


def test_a_worker_killed_alone_leaves_its_running_job_to_finish_and_return_its_output(prefect_api, tmp_path):
    """kill -9 of the worker process alone while its job's work prints a line
    every 0.5 s: the flow process does not write into the dead worker's
    pipe (it crashed there with ``BrokenPipeError`` at the next line, and
    the job ended with no manifest), so the job runs on; a worker started
    again finds its flow process alive and leaves it, and the job returns
    its whole output."""
    from prefect.client.orchestration import get_client

    with queue(tmp_path, {"n1": 0}) as q:
        (q.root / "prints.py").write_text(PRINTS)
        q.scheduler()
        info = {"E31_NODE_GPUS": "0", "E31_SCRATCH": str(q.root / "scratch-n1"), "PREFECT_LOGGING_LEVEL": "INFO"}
        worker = q.start("worker-n1", "worker", "--pool", str(q.pool), "--node", "n1", env=info)  # its runs log
        wait_for(lambda: _warm_listening(worker), what="the worker's warm process")  # at INFO, as by default
        run_id = q.submit(q.job("outlives", 0, 24, work="prints.py", cpus=2)).split("flow run ")[1].split()[0]
        wait_for(lambda: any((q.root / "scratch-n1").glob("outlives/output/started.json")), what="the job's work")
        os.kill(worker.pid, signal.SIGKILL)  # the worker alone: its flow process (a fork of its warm process) lives
        worker.wait()
        time.sleep(3)  # six lines printed with no worker
        q.start("worker-n1-again", "worker", "--pool", str(q.pool), "--node", "n1", env=info)
        wait_for(lambda: _done(q, "outlives"), timeout=120, what="the job")
        with get_client(sync_client=True) as client:
            wait_for(lambda: client.read_flow_run(run_id).state.is_final(), what="its final state")
            state = client.read_flow_run(run_id).state.type.value
        assert final_manifest(q.root / "out" / "outlives")["status"] == "completed"
        assert json.loads((q.root / "out" / "outlives" / "record.json").read_text()) == {"lines": 24}
        assert state == "COMPLETED"
        assert "had no flow process left" not in (q.root / "worker-n1-again.log").read_text()


def test_a_run_lost_with_its_node_starts_again_there_only_once_its_first_processes_are_gone(prefect_api, tmp_path):
    """kill -9 of the worker alone, and its node taken for lost (``--lease
    10``) while the job runs on: the job (one retry) is crashed, its node
    fenced, and queued again; a worker started again on the node takes it
    back.  Its second attempt's work starts only after the first attempt's
    flow process and work are gone (the first flow process stops itself on
    seeing its run crashed, or the worker started again kills it): never
    two attempts of one run on one node.  (Before fencing, the second start
    found the job's lock held by the first flow process and left the run to
    it.)  The second attempt resumes from the first's newest durable
    checkpoint and returns the output."""
    from prefect.client.orchestration import get_client

    from e31.tasks.supervisor.fence import read_fences
    from tests.deployments.test_fencing import _Deaths

    with queue(tmp_path, {"n1": 0}) as q:
        (q.root / "steps.py").write_text(STEPS)
        q.scheduler("--lease", "10")
        info = {"E31_NODE_GPUS": "0", "E31_SCRATCH": str(q.root / "scratch-n1")}
        worker = q.start("worker-n1", "worker", "--pool", str(q.pool), "--node", "n1", env=info)
        wait_for(lambda: _warm_listening(worker), what="the worker's warm process")
        run_id = q.submit(q.job("twice", 0, 120, work="steps.py", cpus=2, retries=1)).split("flow run ")[1].split()[0]
        durable = q.root / "out" / "twice" / "checkpoints"
        wait_for(lambda: _durable_step(durable) >= 3, what="three durable steps")
        attempts = q.root / "scratch-n1" / "twice" / "output" / "attempts.txt"
        work = int(attempts.read_text().split()[1])
        deaths = _Deaths([work, _flow_process(q, "twice", "n1")])
        try:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
            with get_client(sync_client=True) as client:
                wait_for(lambda: any((s.message or "").startswith("Queued: retry 1 of 1") for s in
                                     client.read_flow_run_states(run_id)), timeout=90, what="the job queued again")
            q.start("worker-n1-again", "worker", "--pool", str(q.pool), "--node", "n1", env=info)

            def second() -> list[str] | None:
                try:
                    line = attempts.read_text().splitlines()[-1].split()
                except (OSError, IndexError):  # the output folder emptied for the second attempt
                    return None
                return line if int(line[1]) != work else None

            wait_for(lambda: second() is not None, timeout=120, what="the second attempt's work")
            started = float(second()[3])
            wait_for(lambda: deaths.last() is not None, timeout=5, what="the first attempt's processes to be gone")
            assert deaths.last() < started, (deaths.gone_at, started)
        finally:
            deaths.stop()
        wait_for(lambda: _done(q, "twice"), timeout=240, what="the job")
        with get_client(sync_client=True) as client:
            wait_for(lambda: client.read_flow_run(run_id).state.is_final(), what="its final state")
            states = [s.type.value for s in client.read_flow_run_states(run_id)]
            assert read_fences(client, q.name) == {}
        again = (q.root / "worker-n1-again.log").read_text()
        assert final_manifest(q.root / "out" / "twice")["status"] == "completed"
        record = q.record("twice")
        assert record["node"] == "n1" and record["resumed_from"] >= 3
        assert states.count("RUNNING") == 2 and states[-1] == "COMPLETED" and "CANCELLED" not in states, states
        assert "is still run by its first flow process" not in again


def test_a_flow_process_left_on_a_lost_node_stops_once_its_run_is_placed_elsewhere(prefect_api, tmp_path):
    """kill -9 of n1's worker alone: its flow process lives on, but n1 is
    taken for lost (``--lease 10``) and the job (one retry) is placed on n2
    once a worker runs there.  The flow process on n1 sees its run placed
    on n2 and stops: its work is killed before its end, it writes no state,
    no checkpoint or output after that and no pending return, and says why
    in the run's log; the attempt on n2 resumes from the newest durable
    checkpoint and returns the only output (before fencing both ran to
    their end and the last return won)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from e31.tasks.supervisor.fence import superseded_message

    with queue(tmp_path, {"n1": 0, "n2": 0}) as q:
        (q.root / "steps.py").write_text(STEPS)
        q.scheduler("--lease", "10")
        worker = q.worker("n1", 0)
        wait_for(lambda: _warm_listening(worker), what="n1's warm process")
        run_id = q.submit(q.job("fenced", 0, 120, work="steps.py", cpus=2, retries=1)).split("flow run ")[1].split()[0]
        durable = q.root / "out" / "fenced" / "checkpoints"
        wait_for(lambda: _durable_step(durable) >= 3, what="three durable steps on n1")
        orphan = _flow_process(q, "fenced", "n1")
        orphan_work = int((q.root / "scratch-n1" / "fenced" / "output" / "attempts.txt").read_text().split()[1])
        os.kill(worker.pid, signal.SIGKILL)  # the worker alone: its flow process lives on
        worker.wait()
        with get_client(sync_client=True) as client:
            wait_for(lambda: any((s.message or "").startswith("Queued: retry 1 of 1") for s in
                                 client.read_flow_run_states(run_id)), timeout=90, what="the job queued again")
        q.worker("n2", 0)
        second = q.root / "scratch-n2" / "fenced" / "output" / "attempts.txt"
        wait_for(second.exists, timeout=120, what="the job to start again on n2")
        wait_for(lambda: _gone(orphan) and _gone(orphan_work), timeout=60, what="n1's flow process and work to end")
        ended_at_step = _durable_step(durable)
        wait_for(lambda: _done(q, "fenced"), timeout=240, what="the job")
        with get_client(sync_client=True) as client:
            wait_for(lambda: client.read_flow_run(run_id).state.is_final(), what="its final state")
            states = [s.type.value for s in client.read_flow_run_states(run_id)]
            logs = [entry.message for entry in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))]
        assert final_manifest(q.root / "out" / "fenced")["status"] == "completed"
        record = q.record("fenced")
        assert record["node"] == "n2" and record["resumed_from"] >= 3
        assert not (q.root / "scratch-n1" / "fenced" / "output" / "record.json").exists()  # n1's work never ended
        assert len((q.root / "scratch-n1" / "fenced" / "output" / "attempts.txt").read_text().splitlines()) == 1
        assert list((q.root / "scratch-n1").rglob("return-pending.json")) == []
        assert not (q.root / "out" / "fenced" / "partial").exists()
        assert ended_at_step < 120
        # n1's process wrote no state after n2's start: Crashed (the scheduler's), queued, then n2's attempt only
        after = states[states.index("CRASHED") + 1:]
        assert set(after[:-2]) == {"SCHEDULED", "PENDING"} and after[-2:] == ["RUNNING", "COMPLETED"], " ".join(states)
        # it stops once it sees its run Crashed (or already queued again), before the run is placed on n2
        assert any(superseded_message(run_id, "n1", f"~ended~{name}") in logs for name in ("Crashed", "Queued")), logs



BLOBS = textwrap.dedent("""
    import json, os, pathlib, sys
    out = pathlib.Path(os.environ["E31_OUTPUT_DIR"])
    for i in range(int(sys.argv[1])):
        (out / f"blob-{i:03d}.bin").write_bytes(os.urandom(1024 * 1024))
    (out / "record.json").write_text(json.dumps({"blobs": int(sys.argv[1])}))
""")


#: Files of 1 MiB the cut job returns.
BLOB_COUNT = 60


def _held_returning(q: Queue, out: Path) -> int:
    """Wait until the flow process of job ``cut`` on n1 has stopped itself
    (:mod:`tests.hold`) right after its destination ``out`` said
    ``returning``: a return under way, no file of it written yet.  Returns its pid."""
    from e31.flows.joblock import lock_holder

    pid = hold.wait_stopped(lambda: lock_holder(str(q.root / "scratch-n1" / "cut"))[0])
    assert json.loads((out / "manifest.json").read_text())["status"] == "returning"
    return pid


@pytest.mark.parametrize("handover", [False, True], ids=["queued", "handed-over"])
def test_a_return_cut_by_a_kill_of_its_flow_process_is_finished_by_the_worker(prefect_api, tmp_path, handover):
    """kill -9 of a job's flow process in the middle of its return (as
    Prefect's worker does 30 s after a cancel's SIGTERM, or the OOM killer):
    the destination said ``returning`` and the job's scratch kept a pending
    record, which before this only ``e31 return`` or the job's next run on
    the node finished.  Its worker delivers it once the flow process has
    ended: every file at the destination with a completed manifest, no
    pending record left, the run ``Completed`` (held ``Pending`` while the
    worker returned, not left ``Crashed``; not ``Running``, which would use
    up a retry) and its log saying what the
    worker did.  The node stays the run's until then: a job waiting for it
    is placed only once the run is ``Completed`` (the scheduler used to give
    the node away in the moment between Prefect's ``Crashed`` and the
    worker's ``Pending``, and both ran on it at once).  Handed over behind
    it (``handed-over``: the cut job overran its 2 s duration, so the
    waiting job is released at once to wait on the node), the waiting job's
    work starts only once the run is ``Completed``: its wait used to end
    with the flow process, while the worker still returned."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from e31.flows.joblock import lock_holder

    with queue(tmp_path, {"n1": 0}) as q:
        (q.root / "blobs.py").write_text(BLOBS)
        q.scheduler()
        worker = q.worker("n1", 0, env=hold.env("returning", q.root / "held"))
        wait_for(lambda: _warm_listening(worker), what="n1's warm process")
        spec = q.job("cut", 0, BLOB_COUNT, work="blobs.py", cpus=2, duration="2s" if handover else "1m")
        run_id = q.submit(spec).split("flow run ")[1].split()[0]
        out = q.root / "out" / "cut"
        waiting = q.submit(q.job("next", 0, 0.5, cpus=2)).split("flow run ")[1].split()[0]  # the node's 2 CPUs

        flow_pid = _held_returning(q, out)
        assert lock_holder(str(q.root / "scratch-n1" / "cut")) == (flow_pid, run_id)
        if handover:  # within the scheduler's 10 s hand-over window from its start: released to wait behind it
            wait_for(lambda: _handed_over(q, run_id), what="the waiting job's hand-over")
        os.kill(flow_pid, signal.SIGKILL)
        wait_for(lambda: final_manifest(out) is not None, timeout=120, what="the return to be finished")
        with get_client(sync_client=True) as client:
            wait_for(lambda: client.read_flow_run(run_id).state.is_final(), what="its final state")
            states = [s.type.value for s in client.read_flow_run_states(run_id)]
            attempts = client.read_flow_run(run_id).run_count  # the worker's return uses none of its retries
            said = (f"the return of flow run {run_id} was cut when its flow process ended; the worker finished it: "
                    f"completed, {BLOB_COUNT + 1} file(s)")
            wait_for(lambda: said in [entry.message for entry in client.read_logs(
                LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))], timeout=30, what="the worker's log line")
        manifest = final_manifest(out)
        assert (manifest["status"], manifest["run_id"]) == ("completed", run_id)
        assert sorted(f["path"] for f in manifest["files"]) == [f"blob-{i:03d}.bin" for i in range(BLOB_COUNT)] + ["record.json"]
        assert all(f["sha256"] == _sha256(out / f["path"]) for f in manifest["files"])
        assert list((q.root / "scratch-n1" / "cut").rglob("return-pending.json")) == []  # "next" may be returning
        # Prefect's worker marks the run Crashed as the flow process ends; E31's holds it Pending while it returns
        assert states[states.index("CRASHED"):] == ["CRASHED", "PENDING", "COMPLETED"], states
        assert attempts == 1
        wait_for(lambda: (q.root / "out" / "next" / "record.json").exists(), what="the waiting job's run")
        with get_client(sync_client=True) as client:
            done = next(s.timestamp for s in client.read_flow_run_states(run_id) if s.type.value == "COMPLETED")
            placed = [s for s in client.read_flow_run_states(waiting) if s.name == "Placed"]
        assert len(placed) == 1
        if handover:  # released while the cut run still held the node; its work waited for the return's end
            assert placed[0].message.startswith(f"handed over behind cut ({run_id[:8]}) on n1"), placed[0].message
            # the output returned (its final manifest written by the worker) frees the node, as a plain return's
            # does; the run's Completed comes a moment later (12 ms in a CI run)
            returned = (out / "manifest.json").stat().st_mtime
            assert returned <= done.timestamp() + 1 and q.record("next")["start"] >= returned, (
                q.record("next")["start"], returned, done)
        else:
            assert placed[0].timestamp >= done, (placed[0].timestamp, done)


PLACE_AWAY = textwrap.dedent("""
    import json, os, pathlib, sys
    from datetime import datetime, timedelta, timezone
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.states import Running, Scheduled
    out = pathlib.Path(os.environ["E31_OUTPUT_DIR"])
    (out / "record.json").write_text(json.dumps({"node": os.environ.get("E31_NODE")}))
    with get_client(sync_client=True) as client:  # as the scheduler and n2's worker would: placed on n2, started
        for run in client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[sys.argv[1]]))):
            later = datetime.now(timezone.utc) + timedelta(hours=1)  # queued (no worker takes it), then placed on n2
            client.set_flow_run_state(run.id, Scheduled(name="Queued", scheduled_time=later), force=True)
            client.update_flow_run(run.id, parameters={**run.parameters, "placement": {
                "e31_node": "n2", "gpu_devices": [], "cpus": 1, "e31_attempt": 0}})
            client.set_flow_run_state(run.id, Running(), force=True)
""")


def test_a_flow_process_whose_run_is_placed_elsewhere_as_it_ends_writes_no_final_state(prefect_api, tmp_path):
    """A run on n1 whose node was taken for lost is placed on n2 and started
    there while n1's flow process still returns its output (here its work
    does the scheduler's and n2's part as it ends; no scheduler runs).  n1's
    flow process, whatever it returned, then ends without writing the run's
    final state: a ``Completed`` from n1 freed n2's resources while the work
    there still ran.  It says why in the run's log."""
    from datetime import datetime, timezone

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.states import Scheduled

    from e31.tasks.supervisor.fence import superseded_message

    with queue(tmp_path, {"n1": 0, "n2": 0}) as q:
        (q.root / "away.py").write_text(PLACE_AWAY)
        worker = q.worker("n1", 0)
        wait_for(lambda: _warm_listening(worker), what="n1's warm process")
        spec = q.job("away", 0, 1)
        raw = json.loads(spec.read_text())
        raw["work"]["command"] = [sys.executable, "away.py", "away"]
        spec.write_text(json.dumps(raw))
        run_id = q.submit(spec).split("flow run ")[1].split()[0]
        with get_client(sync_client=True) as client:  # placed on n1 by hand (no scheduler runs here)
            place_by_hand(client, run_id, "n1")
            client.set_flow_run_state(run_id, Scheduled(name="Placed", scheduled_time=datetime.now(timezone.utc)),
                                      force=True)
            said = superseded_message(run_id, "n1", "n2")
            wait_for(lambda: said in [entry.message for entry in client.read_logs(
                LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))], timeout=120, what="n1's step aside")
            time.sleep(3)  # what n1's worker would write after its flow process ended, it has written
            states = [(s.type.value, s.name) for s in client.read_flow_run_states(run_id)]
        manifest = final_manifest(q.root / "out" / "away")
    # n1's start, then the work's placement on n2 and n2's start: nothing written after it from n1
    assert states[-6:] == [("SCHEDULED", "Placed"), ("PENDING", "Pending"), ("PENDING", "Submitting"),
                           ("RUNNING", "Running"), ("SCHEDULED", "Queued"), ("RUNNING", "Running")], states
    assert not any(kind in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for kind, _ in states), states
    if manifest is not None:  # its return had begun before the placement was seen: whole, and n1's attempt's
        assert manifest["status"] == "completed" and manifest["attempt"].startswith("n1-")
        assert [f["path"] for f in manifest["files"]] == ["record.json"]
    assert list((q.root / "scratch-n1").rglob("return-pending.json")) == []

def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True

def test_a_frozen_server_does_not_make_live_nodes_look_lost(prefect_api, tmp_path):
    """The Prefect server stopped (SIGSTOP) for twice the lease while a job
    runs, and its worker heard from only 6 s after the server answers again:
    meanwhile every heartbeat the server holds is past the lease, but the
    scheduler waits LOST_CONFIRM_S before calling the node lost, so the job
    is not crashed and completes (e31.flows.queue.cache)."""
    from prefect.client.orchestration import get_client

    from tests.conftest import SERVER

    with queue(tmp_path, {"n1": 0}) as q:
        q.scheduler("--lease", "15")
        worker = q.worker("n1", 0)
        run_id = q.submit(q.job("through-freeze", 0, 45, cpus=2)).split("flow run ")[1].split()[0]
        wait_for(lambda: any((q.root / "scratch-n1").glob("through-freeze/output/started.json")), what="the work")
        os.killpg(SERVER[0].pid, signal.SIGSTOP)
        os.kill(worker.pid, signal.SIGSTOP)  # the worker alone (its flow process runs on): its heartbeats stop too
        try:
            time.sleep(30)
            os.killpg(SERVER[0].pid, signal.SIGCONT)
            time.sleep(6)  # the scheduler ticks with a heartbeat 36 s old, past the 15 s lease; then the worker
        finally:  # comes back (as a worker whose requests were backing off would), within LOST_CONFIRM_S
            os.killpg(SERVER[0].pid, signal.SIGCONT)
            os.kill(worker.pid, signal.SIGCONT)
        wait_for(lambda: _done(q, "through-freeze"), timeout=240, what="the job")
        with get_client(sync_client=True) as client:
            wait_for(lambda: client.read_flow_run(run_id).state.is_final(), what="its final state")
            states = [s.type.value for s in client.read_flow_run_states(run_id)]
    assert "CRASHED" not in states and states[-1] == "COMPLETED"
    assert json.loads((tmp_path / "out" / "through-freeze" / "manifest.json").read_text())["status"] == "completed"


def test_a_deadline_job_handed_over_behind_a_job_that_overruns_never_starts_too_late(prefect_api, tmp_path):
    """A deadline job handed over behind a job that runs far past its
    declared duration waits for it, and must not then start its work after
    its deadline less the return reserve (killed at once: ``partial``,
    ``deadline``).  The run checks its deadline again as its work is about to
    start: it ends ``Failed`` with a ``failed`` manifest saying why, and the
    work never starts."""
    from datetime import datetime, timedelta, timezone

    from prefect.client.orchestration import get_client

    with queue(tmp_path, {"n1": 0}) as q:
        q.scheduler()
        worker = q.worker("n1", 0)
        wait_for(lambda: _warm_listening(worker), what="the worker's warm process")
        q.submit(q.job("overrun", 0, 40, cpus=2, duration="10s"))  # declared 10 s, runs 40 s
        wait_for(lambda: any((q.root / "scratch-n1").glob("overrun/output/started.json")), what="the first job")
        deadline = (datetime.now(timezone.utc) + timedelta(seconds=50)).isoformat(timespec="seconds")
        late = q.submit(q.job("late", 0, 1, cpus=2, deadline=deadline)).split("flow run ")[1].split()[0]
        with get_client(sync_client=True) as client:
            wait_for(lambda: client.read_flow_run(late).state.is_final(), timeout=120, what="its end")
            run = client.read_flow_run(late)
            placed = next(s for s in client.read_flow_run_states(late) if s.name == "Placed")
    assert placed.message.startswith("handed over behind overrun"), placed.message
    assert run.state.type.value == "FAILED", run.state
    said = json.loads((tmp_path / "out" / "late" / "partial" / "manifest.json").read_text())
    assert (said["status"], said["reason"], said["files"]) == ("failed", "error", []), said
    assert said["message"].startswith("request.deadline: the deadline ") and "leaves no time to run" in said["message"]
    assert not (q.root / "scratch-n1" / "late" / "output" / "started.json").exists()  # the work never started


#: A work's wait that ends when the test creates the file ``go`` in the queue's folder (at most 5 minutes).
UNTIL_GO = "while not pathlib.Path({go!r}).exists() and time.time() < record['start'] + 300: time.sleep(0.05)"


def test_the_next_job_is_handed_over_behind_the_running_one_and_its_work_waits_for_it(prefect_api, tmp_path):
    """``--handover 30``: the job planned next on a running job's devices,
    whose planned end is within 30 s, is released at once (``e31_after``):
    its flow process starts and stages its input while the job ahead runs,
    and its work starts only once the job ahead has ended (its flow run
    final), on the same devices.  Its staging is not metered: the node was
    still the job ahead's (e31.flows.queue.handover)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with queue(tmp_path, {"n1": 2}) as q:
        q.scheduler("--handover", "30")
        worker = q.start("worker-n1", "worker", "--pool", str(q.pool), "--node", "n1",  # its runs log at INFO
                         env={"E31_NODE_GPUS": "2", "E31_SCRATCH": str(q.root / "scratch-n1"),
                              "PREFECT_LOGGING_LEVEL": "INFO"})
        wait_for(lambda: _warm_listening(worker), what="the worker's warm process")
        source = q.root / "input.bin"
        source.write_bytes(os.urandom(2**20))
        # the job ahead runs until the test lets it end (file "go"); planned end: start + 25 s
        (q.root / "ahead.py").write_text(WORK.replace("time.sleep(float(sys.argv[1]))",
                                                           UNTIL_GO.format(go=str(q.root / "go"))))
        ahead = q.submit(q.job("ahead", 2, 20, work="ahead.py")).split("flow run ")[1].split()[0]
        wait_for(lambda: any((q.root / "scratch-n1").glob("ahead/output/started.json")), what="the first job's work")
        behind = q.submit(q.job("behind", 2, 1, data=[{"name": "inp", "url": str(source)}])).split("flow run ")[1]
        behind = behind.split()[0]
        with get_client(sync_client=True) as client:
            wait_for(lambda: client.read_flow_run(behind).state.type.value == "RUNNING", what="its flow process")
            listed = subprocess.run([q.exe, "queue", "--pool", str(q.pool)], capture_output=True, text=True,
                                    cwd=q.root)
            still_running = not (q.root / "scratch-n1" / "ahead" / "output" / "record.json").exists()
            (q.root / "go").touch()
            wait_for(lambda: _done(q, "ahead", "behind"), timeout=180, what="both jobs")
            wait_for(lambda: client.read_flow_run(behind).state.is_final(), what="its final state")
            returned = (q.root / "out" / "ahead" / "manifest.json").stat().st_mtime  # its output returned
            placed = next(s for s in client.read_flow_run_states(behind) if s.name == "Placed")
            said = f"handed over behind ahead ({ahead[:8]}): the work starts once it has returned its output"
            wait_for(lambda: said in [log.message for log in client.read_logs(LogFilter(
                flow_run_id=LogFilterFlowRunId(any_=[behind])))], what="its log line")  # sent at its end
            logged = [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[behind])))]
        first, second = q.record("ahead"), q.record("behind")
        manifest = json.loads((q.root / "out" / "behind" / "manifest.json").read_text())
    assert still_running  # its flow run was Running while the job ahead's work still ran
    assert not [m for m in logged if "was cut during the return" in m]  # a plain return says nothing of a cut
    assert placed.message.startswith(f"handed over behind ahead ({ahead[:8]}) on n1: its flow process starts now and "
                                     "stages the inputs; the work starts once ahead has returned its output (planned ")
    assert second["start"] >= returned  # the work waited for the job ahead's end: its manifest written last
    assert first["devices"] == second["devices"] == "0,1" and second["node"] == "n1"
    assert manifest["status"] == "completed" and manifest["staged_before_allocation"] is True
    assert manifest["timings"]["staging_s"] == 0.0 and manifest["timings"]["handover_wait_s"] > 0
    assert manifest["timings"]["handover_staging_s"] > 0  # its own staging, made before the allocation
    # billed from its work's start to its release (e31.tasks.meter): not its staging nor its wait behind the job ahead
    meter = manifest["meter"]
    assert returned - 0.01 <= meter["started_at"] <= second["start"] and meter["released_at"] >= second["end"]
    assert meter["gpu_seconds"] == round(2 * meter["seconds"], 3)
    lines = listed.stdout.split("\n\n")[0].splitlines()
    assert [line.split()[:4] for line in lines[1:]] == [["ahead", ahead[:8], "Running", "n1"],
                                                       ["behind", behind[:8], "Running", "n1"]]
    assert lines[2].split()[4:6] == ["0,1", "-"]
    assert lines[2].endswith(f"handed over behind ahead ({ahead[:8]}): its work starts once that job has returned "
                             "its output")


def _handed_over(q: Queue, ahead: str) -> bool:
    """Whether a run waits behind the run ``ahead`` on n1 (its marker, e31.flows.queue.handover)."""
    return (q.root / "scratch-n1" / ".handover" / ahead).exists()


def test_a_job_waiting_behind_another_ends_with_its_manifest_when_cancelled_or_drained(prefect_api, tmp_path):
    """A cancel or a worker's drain while a handed-over run waits must not
    kill its flow process (Prefect's abort on SIGTERM) and leave no
    manifest; each ends with a partial manifest saying why, and the
    job ahead is not disturbed by the cancel."""
    from prefect.client.orchestration import get_client

    with queue(tmp_path, {"n1": 0}) as q:
        q.scheduler("--handover", "120")
        worker = q.worker("n1", 0)
        wait_for(lambda: _warm_listening(worker), what="the worker's warm process")
        ahead = q.submit(q.job("long-a", 0, 60, cpus=2)).split("flow run ")[1].split()[0]
        wait_for(lambda: any((q.root / "scratch-n1").glob("long-a/output/started.json")), what="the first job's work")
        first = q.submit(q.job("wait-b", 0, 1, cpus=2)).split("flow run ")[1].split()[0]
        wait_for(lambda: _handed_over(q, ahead), what="the handed-over run's wait")
        out = subprocess.run([q.exe, "cancel", first, "--pool", str(q.pool)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        # e31 cancel does not wait for the run's end: its manifest (and the end of its wait, whose marker the
        # next run's wait below looks for) comes once its flow process saw the cancel
        wait_for(lambda: final_manifest(tmp_path / "out" / "wait-b" / "partial") is not None, timeout=60,
                 what="the cancelled job's manifest")
        cancelled = final_manifest(tmp_path / "out" / "wait-b" / "partial")
        second = q.submit(q.job("wait-c", 0, 1, cpus=2)).split("flow run ")[1].split()[0]
        wait_for(lambda: _handed_over(q, ahead), what="the second handed-over run's wait")
        os.killpg(worker.pid, signal.SIGINT)  # a Ctrl-C of the worker: it drains
        worker.wait(timeout=120)
        drained = final_manifest(tmp_path / "out" / "wait-c" / "partial")
        ahead_manifest = final_manifest(tmp_path / "out" / "long-a" / "partial")
        with get_client(sync_client=True) as client:
            states = [client.read_flow_run(r).state for r in (first, second, ahead)]
    assert (cancelled["status"], cancelled["reason"], cancelled["files"]) == ("partial", "cancelled", [])
    assert cancelled["message"] == ("cancelled while it waited for the job ahead of it on its node; the work did not "
                                    "start")
    assert (drained["status"], drained["reason"], drained["files"]) == ("partial", "signal", [])
    assert drained["message"] == ("stopped by a signal while it waited for the job ahead of it on its node; the work "
                                  "did not start")
    assert (ahead_manifest["status"], ahead_manifest["reason"]) == ("partial", "signal")  # the drain, not the cancel
    assert [s.type.value for s in states] == ["CANCELLED", "COMPLETED", "COMPLETED"]
    assert not (tmp_path / "scratch-n1" / "wait-b" / "output" / "started.json").exists()  # never ran


def test_the_work_of_a_killed_flow_process_is_ended_before_the_job_behind_starts(prefect_api, tmp_path):
    """The work under a shell must not outlive its killed flow process
    (kill -9) with the job handed over behind it started on the same
    devices beside it: the leftover work is killed first."""
    with queue(tmp_path, {"n1": 2}) as q:
        q.scheduler("--handover", "120")
        worker = q.worker("n1", 2)
        wait_for(lambda: _warm_listening(worker), what="the worker's warm process")
        spec = q.job("shelled", 2, 40)
        shelled = json.loads(spec.read_text())
        shelled["work"]["command"] = ["/bin/sh", "-c", f"{sys.executable} {q.root / 'work.py'} 40; true"]
        spec.write_text(json.dumps(shelled))
        ahead = q.submit(spec).split("flow run ")[1].split()[0]
        started = q.root / "scratch-n1" / "shelled" / "output" / "started.json"
        wait_for(started.exists, what="the first job's work")
        q.submit(q.job("next-up", 2, 1))
        wait_for(lambda: _handed_over(q, ahead), what="the handed-over run's wait")
        work = json.loads(started.read_text())["pid"]
        shell = int(Path(f"/proc/{work}/stat").read_text().rsplit(")", 1)[1].split()[1])
        flow = int(Path(f"/proc/{shell}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(flow, signal.SIGKILL)  # the flow process; its shell dies with it, the work under it does not
        killed_at = time.time()
        wait_for(lambda: final_manifest(q.root / "out" / "next-up"), timeout=120, what="the job behind")
        alive = Path(f"/proc/{work}").exists() and b"work.py" in Path(f"/proc/{work}/cmdline").read_bytes()
        behind = q.record("next-up")
    assert not alive  # the orphaned work was killed ...
    assert not (q.root / "scratch-n1" / "shelled" / "output" / "record.json").exists()  # ... before its 40 s ended
    assert killed_at < behind["start"] < json.loads(started.read_text())["start"] + 40
    assert behind["devices"] == "0,1"


def test_a_second_scheduler_on_a_pool_waits_as_a_standby_and_takes_over(prefect_api, tmp_path):
    """Two schedulers on one pool would place runs on the same resources:
    a second one waits as a standby (and says so), ``--once`` refuses
    while one serves, ``e31 queue`` reads the serving one's ``--lease``,
    and once the first stops the standby serves: a job submitted then
    runs."""
    from prefect.client.orchestration import get_client

    from e31.deployments.presence import STALE_S, lease_of, read_claim

    with queue(tmp_path, {"n1": 0}) as q:
        q.scheduler("--lease", "25")
        first = q.procs["scheduler"]
        with get_client(sync_client=True) as client:
            wait_for(lambda: read_claim(client, q.name) is not None, what="the first scheduler's claim")
            assert read_claim(client, q.name)["id"].endswith(f"-{first.pid}-" + read_claim(client, q.name)["id"][-6:])
            assert lease_of(client, q.name, 60.0) == (25.0, True)
        once = subprocess.run([q.exe, "scheduler", "--pool", str(q.pool), "--once"], capture_output=True, text=True,
                              cwd=q.root)
        claim_id = read_claim(get_client(sync_client=True), q.name)["id"]
        assert once.returncode == 1, once
        assert once.stderr.startswith(f"e31 scheduler: another e31 scheduler serves pool {q.name} ({claim_id}, heard ")
        assert once.stderr.endswith(" s ago): one scheduler per pool, or both would place runs on the same "
                                    "resources; stop that one first\n"), once.stderr
        second = q.start("scheduler-2", "scheduler", "--pool", str(q.pool), "--interval", "0.5")
        said = (f"waits as a standby and takes over {STALE_S:g} s after that one's last beat")
        wait_for(lambda: said in (q.root / "scheduler-2.log").read_text(), what="the standby's word")
        stop_group(first, timeout=20)  # stopped: it deletes its claim, and the standby serves within seconds
        with get_client(sync_client=True) as client:
            wait_for(lambda: (read_claim(client, q.name) or {}).get("id", "").split("-")[-2:-1] == [str(second.pid)],
                     timeout=30, what="the standby's claim")
            assert lease_of(client, q.name, 60.0) == (60.0, True)  # its own (default) lease
        took = f" e31 scheduler: the pool's scheduler has stopped; this one serves pool {q.name} now\n"
        wait_for(lambda: took in (q.root / "scheduler-2.log").read_text(), timeout=10, what="the standby's takeover")
        q.worker("n1", 0)
        q.submit(q.job("after", 0, 0.5))
        wait_for(lambda: (q.root / "out" / "after" / "record.json").exists(), what="the job placed by the standby")
        stop_group(second, timeout=20)
        with get_client(sync_client=True) as client:
            assert read_claim(client, q.name) is None and lease_of(client, q.name, 60.0) == (60.0, False)
