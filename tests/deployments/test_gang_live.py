"""A job across two nodes on the live queue: one flow run, its lead on one node's ``e31 worker`` and its
member on the other's, meeting through ``torch.distributed`` (gloo, CPU) at the rendezvous the lead
published; real ``e31 scheduler``, ``e31 worker`` processes and Prefect server.  Both nodes are on this
machine (each worker its own scratch); the same across network-namespace hosts is in test_hosts.py."""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

from tests.conftest import final_manifest
from tests.procs import stop_group
from tests.deployments.test_queue import queue, wait_for

#: Data-parallel training of a linear model: each rank's batch differs, gradients are averaged with
#: all_reduce, so every rank holds the same weights after each step; the lead checkpoints.  Each rank writes
#: what it saw; the lead's files are the job's output.
GANG_WORK = textwrap.dedent("""
    import hashlib, json, os, time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    def main(ctx):
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        start = 0
        restored = ctx.restore()
        if restored is not None:
            state, start = restored
            model.load_state_dict(state["model"])
        steps, done = ctx.params["steps"], start
        for step in range(start, steps):
            x = torch.full((8, 4), float(step + ctx.rank + 1))
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            model.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ctx.world_size
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.001 * p.grad
            done = step + 1
            if ctx.is_lead and ctx.checkpoint_due(done):
                ctx.checkpoint({"model": model.state_dict()}, step=done)
            time.sleep(ctx.params["step_s"])
            stop = torch.tensor([1 if ctx.should_stop else 0])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank leaves the loop at the same step
            if stop.item():
                break
        weights = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values()))
        seen = {"rank": ctx.rank, "world_size": ctx.world_size, "node": os.environ["E31_NODE"], "start": start,
                "done": done, "weights": weights.hexdigest(), "master": os.environ["MASTER_ADDR"]}
        (ctx.output_dir / "seen.json").write_text(json.dumps(seen, sort_keys=True))
        print(f"rank {ctx.rank} of {ctx.world_size} trained to step {done}", flush=True)
        if ctx.is_lead:
            torch.save(model.state_dict(), ctx.output_dir / "model.pt")
        dist.destroy_process_group()
""")


def gang_spec(root: Path, out: str | Path, steps: int, step_s: float, every: int | None = 10, name: str = "gang",
              **request: object) -> Path:
    """The spec of a 2-node job of :data:`GANG_WORK` (written to ``root/gangwork.py``), ``steps`` steps of
    ``step_s`` seconds, the lead checkpointing every ``every`` steps (None: never), returning to ``out``;
    ``request`` adds to or replaces its request (1 CPU per node, a 5-minute limit)."""
    (Path(root) / "gangwork.py").write_text(GANG_WORK)
    output: dict = {"kind": "model", "url": str(out), "files": ["seen.json", "model.pt"]}
    if every:
        output["checkpoint"] = {"every_steps": every}
    spec = Path(root) / f"{name}.yaml"
    spec.write_text(json.dumps({
        "name": name, "work": {"kind": "training", "entrypoint": "gangwork:main",
                               "params": {"steps": steps, "step_s": step_s}},
        "request": {"nodes": 2, "cpus": 1, "limit": "5m", **request}, "output": output}))
    return spec


def test_a_two_node_job_trains_as_one_gang_and_returns_the_leads_output(prefect_api, tmp_path):
    """Also: the rendezvous port range's first port is taken (another program listens there), so the lead
    meets its member on the next free one."""
    import socket

    from prefect.client.orchestration import get_client

    from prefect.client.schemas.filters import LogFilter

    from e31.flows.gang.rendezvous import member_ends, published

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    first = taken.getsockname()[1]
    ports = {"E31_RENDEZVOUS_PORTS": f"{first}-{first + 50}"}
    with taken, queue(tmp_path, {"n1": 0, "n2": 0}) as q:
        spec = gang_spec(tmp_path, tmp_path / "out" / "gang", 20, 0.05, every=5, duration="30s")
        q.scheduler()
        q.worker("n1", 0, env=ports)
        q.worker("n2", 0, env=ports)
        q.submit(spec)
        out = tmp_path / "out" / "gang"
        wait_for(lambda: final_manifest(out) is not None or _failed(q), timeout=300,
                 what="the gang's output")
        manifest = final_manifest(out)
        with get_client(sync_client=True) as client:  # the member writes its end as its work's process ends
            wait_for(lambda: member_ends(client.read_flow_run(manifest["run_id"]), 1), timeout=60,
                     what="the member's end written on the run")
            run = client.read_flow_run(manifest["run_id"])
            logs = [log.message for log in client.read_logs(LogFilter(flow_run_id={"any_": [run.id]}))]
        lead = json.loads((out / "seen.json").read_text())
        placement = (run.parameters or {}).get("placement") or {}
        member_node = "n2" if placement.get("e31_node") == "n1" else "n1"
        member = json.loads((tmp_path / f"scratch-{member_node}" / "gang" / "member" / "output" / "seen.json")
                            .read_text())
    assert (manifest["status"], manifest["reason"], manifest["step"]) == ("completed", "finished", 20)
    assert placement["e31_gang"] == [[member_node, []]] and placement["e31_node"] != member_node
    assert {t for t in run.tags if t.startswith(("e31-placed:", "e31-member:"))} == {
        f"e31-placed:{placement['e31_node']}", f"e31-member:{member_node}"}
    pub = published(run)
    assert (pub.attempt, pub.addr, pub.resume) == (1, "127.0.0.1", None) and first < pub.port <= first + 50
    assert member_ends(run, 1) == {1: 0}
    assert (lead["rank"], lead["world_size"], lead["node"], lead["done"]) == (0, 2, placement["e31_node"], 20)
    assert (member["rank"], member["world_size"], member["node"], member["done"]) == (1, 2, member_node, 20)
    assert lead["weights"] == member["weights"]  # averaged gradients: one model on both ranks
    assert "rank 1: rank 1 of 2 trained to step 20" in logs  # the member's work output, in the flow run's log
    assert [f["path"] for f in manifest["files"]] == ["model.pt", "seen.json"]
    assert manifest["files"][0]["sha256"] == hashlib.sha256((out / "model.pt").read_bytes()).hexdigest()
    meter = manifest["meter"]  # both nodes' CPUs billed: 1 CPU on each
    assert meter["cpu_seconds"] == round(2 * meter["seconds"], 3) and meter["gpu_seconds"] == 0


def test_a_gang_stopped_by_its_time_limit_resumes_on_every_rank_from_the_leads_checkpoint(prefect_api, tmp_path):
    """The time limit warns both ranks at once (each leaves at the same step through an all_reduce), the
    lead's checkpoint of that step comes back in the partial output, and the job submitted again starts
    both ranks from exactly that step."""
    from e31.tasks.work.local_checkpoints import MARKER

    def spec(limit: str) -> Path:
        return gang_spec(tmp_path, tmp_path / "out" / "gang", 600, 0.1, limit=limit, grace="5s")

    out = tmp_path / "out" / "gang"
    with queue(tmp_path, {"n1": 0, "n2": 0}) as q:
        q.scheduler()
        q.worker("n1", 0)
        q.worker("n2", 0)
        q.submit(spec("40s"))  # past the ranks' start and several checkpoints, also on a loaded machine
        wait_for(lambda: final_manifest(out / "partial") is not None or _failed(q), timeout=300,
                 what="the partial output")
        partial = final_manifest(out / "partial")
        stopped = partial["step"]
        durable = (out / "checkpoints" / f"step-{stopped}" / MARKER).is_file()  # (pruned later: keep 3)
        q.submit(spec("5m"))
        wait_for(lambda: final_manifest(out) is not None or _failed(q), timeout=300,
                 what="the resumed output")
        done = final_manifest(out)
        lead = json.loads((out / "seen.json").read_text())
        member_node = "n2" if lead["node"] == "n1" else "n1"
        member = json.loads((tmp_path / f"scratch-{member_node}" / "gang" / "member" / "output" / "seen.json")
                            .read_text())
    assert (partial["status"], partial["reason"]) == ("partial", "time_limit")
    assert 0 < stopped < 600 and durable
    assert (done["status"], done["step"], done["resumed_from_step"]) == ("completed", 600, stopped)
    assert (lead["start"], member["start"]) == (stopped, stopped)  # both ranks from the lead's checkpoint
    assert (lead["done"], member["done"]) == (600, 600) and lead["weights"] == member["weights"]


def test_a_member_killed_mid_run_fails_the_try_and_the_retry_resumes_every_rank(prefect_api, tmp_path):
    """kill -9 of the member's work: the lead's next collective fails at once (no rank is left hanging),
    its work is tried again (``retries: 1``) with a new rendezvous, the member's worker starts a member
    for it, and both ranks resume from the lead's newest checkpoint."""
    import os
    import signal

    from prefect.client.orchestration import get_client

    from e31.flows.gang.rendezvous import member_ends, published

    out = tmp_path / "out" / "gang"
    with queue(tmp_path, {"n1": 0, "n2": 0}) as q:
        spec = gang_spec(tmp_path, out, 200, 0.1, retries=1)
        q.scheduler()
        q.worker("n1", 0)
        q.worker("n2", 0)
        q.submit(spec)

        member_node = _member_past_a_checkpoint(q, tmp_path, out)
        config_path = str(tmp_path / f"scratch-{member_node}" / "gang" / "member" / "run" / "child.json")
        victims = [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(int(p), "e31.tasks.work.child")
                   and _cmdline_has(int(p), config_path)]  # this test's member's work, whatever else runs
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        wait_for(lambda: final_manifest(out) is not None or _failed(q), timeout=300,
                 what="the output after the retry")
        manifest = final_manifest(out)
        with get_client(sync_client=True) as client:
            wait_for(lambda: member_ends(client.read_flow_run(manifest["run_id"]), 1) == {1: 0}, timeout=60,
                     what="the second member's end written on the run")
            run = client.read_flow_run(manifest["run_id"])
        lead = json.loads((out / "seen.json").read_text())
        member = json.loads((tmp_path / f"scratch-{member_node}" / "gang" / "member" / "output" / "seen.json")
                            .read_text())
        said = (tmp_path / f"scratch-{member_node}" / "gang" / "member" / "member.log").read_text().splitlines()
    assert (manifest["status"], manifest["step"]) == ("completed", 200)
    assert run.run_count == 1  # one attempt: the work was tried again within it
    assert [line.split(":", 1)[1].strip() for line in said if "work ended" in line] == [
        "work ended with exit status -9", "work ended with exit status 0"]
    assert 10 <= lead["start"] == member["start"] < 200  # both from the lead's checkpoint, not from step 0
    assert (lead["done"], member["done"]) == (200, 200) and lead["weights"] == member["weights"]
    assert published(run).resume == lead["start"]


def test_the_leads_flow_process_killed_stops_the_member_and_the_run_resumes_every_rank(prefect_api, tmp_path):
    """kill -9 of the lead's flow process (its supervisor): its work dies with it (parent-death signal),
    Prefect's worker reports the run crashed, the member stops its work as the run leaves ``Running``
    (its peer is gone: nothing is left waiting in a collective), and the run, queued again
    (``retries``), starts both ranks from the lead's newest durable checkpoint in its second attempt."""
    import os
    import signal

    from prefect.client.orchestration import get_client

    out = tmp_path / "out" / "gang"
    with queue(tmp_path, {"n1": 0, "n2": 0}) as q:
        spec = gang_spec(tmp_path, out, 300, 0.1, retries=1)
        q.scheduler()
        q.worker("n1", 0)
        q.worker("n2", 0)
        run_id = q.submit(spec).split("flow run ")[1].split()[0]

        found = {"member": _member_past_a_checkpoint(q, tmp_path, out)}
        lead_node = "n2" if found["member"] == "n1" else "n1"
        lead_config = str(tmp_path / f"scratch-{lead_node}" / "gang" / "run" / "child.json")
        member_config = str(tmp_path / f"scratch-{found['member']}" / "gang" / "member" / "run" / "child.json")
        (work,) = [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(int(p), lead_config)]
        (member_work,) = [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(int(p), member_config)]
        flow = int(Path(f"/proc/{work}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(flow, signal.SIGKILL)
        wait_for(lambda: not _cmdline_has(member_work, member_config), timeout=60,
                 what="the member's work of the first attempt stopped")
        wait_for(lambda: final_manifest(out) is not None or _failed(q, crashed=False), timeout=300,
                 what="the output of the second attempt")
        manifest = final_manifest(out)
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(run_id)
        lead = json.loads((out / "seen.json").read_text())
        member_node = (run.parameters or {})["placement"]["e31_gang"][0][0]
        member = json.loads((tmp_path / f"scratch-{member_node}" / "gang" / "member" / "output" / "seen.json")
                            .read_text())
    assert (manifest["status"], manifest["step"], run.run_count) == ("completed", 300, 2)
    assert 10 <= manifest["resumed_from_step"] == lead["start"] == member["start"] < 300
    assert (lead["done"], member["done"]) == (300, 300) and lead["weights"] == member["weights"]


def test_a_member_nodes_worker_killed_ends_the_gang_which_resumes_on_other_nodes(prefect_api, tmp_path):
    """kill -9 of the member node's ``e31 worker``: the member and its work die with it (their parent-death
    signal), so no end of theirs is ever written and the lead's try is lost; the node is taken for lost
    past its lease (10 s), the run crashed, fenced there and queued again (``retries``); it is placed on
    the lead's node and n3, and both ranks resume from the lead's newest durable checkpoint, on a node
    whose scratch never held the job."""
    import os
    import signal
    import subprocess

    from prefect.client.orchestration import get_client

    out = tmp_path / "out" / "gang"
    with queue(tmp_path, {"n1": 0, "n2": 0, "n3": 0}) as q:
        spec = gang_spec(tmp_path, out, 300, 0.1, retries=2)
        q.scheduler("--lease", "10")
        q.worker("n1", 0)
        q.worker("n2", 0)
        run_id = q.submit(spec).split("flow run ")[1].split()[0]

        lost = _member_past_a_checkpoint(q, tmp_path, out)
        config_path = str(tmp_path / f"scratch-{lost}" / "gang" / "member" / "run" / "child.json")
        work = [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(int(p), config_path)]
        assert len(work) == 1, work
        os.kill(q.procs[f"worker-{lost}"].pid, signal.SIGKILL)
        q.worker("n3", 0)
        with get_client(sync_client=True) as client:
            wait_for(lambda: (client.read_flow_run(run_id).state.message or "").startswith(
                f"Queued: waiting for its attempt on node {lost}, lost while it ran, to be confirmed ended"),
                timeout=120, what="the gang queued again, waiting for the lost node's fence")
        done = subprocess.run([q.exe, "node", lost, "--pool", str(q.pool), "--down"], capture_output=True, text=True,
                              cwd=q.root)  # the operator: that machine is off
        assert done.returncode == 0, done
        wait_for(lambda: final_manifest(out) is not None or _failed(q, crashed=False), timeout=300,
                 what="the output after the gang was queued again")
        manifest = final_manifest(out)
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(run_id)
        placement = (run.parameters or {})["placement"]
        lead = json.loads((out / "seen.json").read_text())
        member_node = placement["e31_gang"][0][0]
        member = json.loads((tmp_path / f"scratch-{member_node}" / "gang" / "member" / "output" / "seen.json")
                            .read_text())
        alive = [pid for pid in work if _cmdline_has(pid, config_path)]
    assert (manifest["status"], manifest["step"]) == ("completed", 300)
    assert lost not in (placement["e31_node"], member_node) and "n3" in (placement["e31_node"], member_node)
    assert run.run_count == 2  # the first attempt lost with the node, the second on n3
    assert 10 <= manifest["resumed_from_step"] == lead["start"] == member["start"] < 300
    assert (lead["done"], member["done"]) == (300, 300) and lead["weights"] == member["weights"]
    assert alive == []  # the lost member's work died with its worker


def test_a_member_that_cannot_start_ends_the_gang_at_once_with_the_reason(prefect_api, tmp_path):
    """A member node whose scratch cannot be written (a file where the member's folder goes): its worker
    cannot start the member and writes that on the run; the lead, whose work waits in
    ``init_process_group`` for a peer that never comes (its own timeout: 120 s), stops it within one read
    of the run (10 s) and the run fails, saying which member and why, and the member's worker says the
    reason in its log."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter

    from e31.flows.gang.rendezvous import member_ends

    out = tmp_path / "out" / "gang"
    with queue(tmp_path, {"n1": 0, "n2": 0}) as q:
        for node in ("n1", "n2"):  # whichever node the member lands on; the lead's staging never uses it
            (tmp_path / f"scratch-{node}" / "gang").mkdir(parents=True)
            (tmp_path / f"scratch-{node}" / "gang" / "member").write_text("not a folder")
        spec = gang_spec(tmp_path, out, 20, 0.05, every=None)
        q.scheduler()
        q.worker("n1", 0)
        q.worker("n2", 0)
        run_id = q.submit(spec).split("flow run ")[1].split()[0]
        with get_client(sync_client=True) as client:
            wait_for(lambda: client.read_flow_run(run_id).state.is_final(), timeout=240, what="the gang's end")
            run = client.read_flow_run(run_id)
            logs = [log.message for log in client.read_logs(LogFilter(flow_run_id={"any_": [run.id]}))]
        manifest = final_manifest(out / "partial")
    member_node = "n2" if (run.parameters or {})["placement"]["e31_node"] == "n1" else "n1"
    assert run.state.type.value == "FAILED", run.state
    assert member_ends(run, 1) == {1: 2}
    assert (manifest["status"], manifest["reason"]) == ("failed", "error"), manifest
    assert manifest["message"] == (f"member rank 1 on node {member_node} ended with exit status 2 (its lines are "
                                   "in the flow run's log); this rank's work was stopped")
    assert manifest["timings"]["run_s"] < 60  # not the work's own 120 s wait for its peer
    worker_log = (q.root / f"worker-{member_node}.log").read_text()
    assert f"cannot start its member on node {member_node}: [Errno 17] File exists" in worker_log
    assert any(line.startswith(f"member on node {member_node}: its e31 worker cannot start it: [Errno 17] File "
                               "exists") for line in logs)  # where the run's message points


def _member_past_a_checkpoint(q, root: Path, out: Path) -> str:
    """Wait until the member's work runs (on n1 or n2) and a checkpoint of the lead's is durable at ``out``;
    the member's node.  Fails at once when a run of the pool fails."""
    found = {}

    def working() -> bool:
        for node in ("n1", "n2"):
            if (root / f"scratch-{node}" / "gang" / "member" / "run" / "child.json").exists() and \
                    any((out / "checkpoints").glob("step-*/COMMITTED")):
                found["node"] = node
                return True
        return _failed(q)

    wait_for(working, timeout=240, what="the member's work past a durable checkpoint")
    return found["node"]


def _cmdline_has(pid: int, text: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return text.encode() in fh.read()
    except OSError:
        return False


def _failed(q, crashed: bool = True) -> bool:
    """Whether a flow run of this test's pool has failed, or crashed (``crashed``; a run lost with its node
    is crashed, then queued again) (the waits end at once then, with the runs listed)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as client:
        return bool(client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType.FAILED, *([StateType.CRASHED] if crashed else [])]))),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[q.name]))))


#: A model sharded by rows across the ranks (a ``DTensor``, as FSDP keeps one), trained by an elementwise
#: update so its values after N steps are known exactly (:func:`_sharded_reference`), saved with
#: ``ctx.checkpoint_sharded`` every ``every`` steps on every rank.  The stop is agreed first (an all_reduce),
#: so every rank takes the same checkpoint, a collective.
SHARDED_WORK = textwrap.dedent("""
    import hashlib, json, os, time
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def main(ctx):
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        mesh = init_device_mesh("cpu", (ctx.world_size,))
        state = {"w": distribute_tensor(torch.zeros(6, 3), mesh, [Shard(0)]), "step": 0}
        start = ctx.restore_sharded(state) or 0
        w, done = state["w"], start
        for step in range(start, ctx.params["steps"]):
            w = w * 0.99 + (step + 1) * 0.01
            done = step + 1
            time.sleep(ctx.params["step_s"])
            stop = torch.tensor([1 if ctx.should_stop else 0])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() or done % ctx.params["every"] == 0:
                ctx.checkpoint_sharded({"w": w, "step": done}, step=done)
            if stop.item():
                break
        full = w.full_tensor()
        seen = {"rank": ctx.rank, "node": os.environ["E31_NODE"], "start": start, "done": done,
                "local": w.to_local().tolist()}
        (ctx.output_dir / "seen.json").write_text(json.dumps(seen, sort_keys=True))
        if ctx.is_lead:
            torch.save(full, ctx.output_dir / "model.pt")
        dist.destroy_process_group()
""")


def _sharded_reference(steps: int):
    import torch

    w = torch.zeros(6, 3)
    for step in range(steps):
        w = w * 0.99 + (step + 1) * 0.01
    return w


def test_a_sharded_checkpoint_of_two_nodes_resumes_exactly_on_two_other_nodes(prefect_api, tmp_path):
    """Both ranks save their shard of each checkpoint (``torch.distributed.checkpoint``) on their own node;
    the step at the checkpoint URL counts once both parts and the lead's marker are there.  The run is
    stopped by its time limit on n1+n2; resubmitted once those two nodes are gone, it is placed on n3+n4,
    whose scratches never held the job: each rank fetches the whole step and loads its own rows, and the
    output equals an uninterrupted run's to the bit."""
    import torch

    from e31.tasks.work.local_checkpoints import MARKER

    out = tmp_path / "out" / "sharded"
    (tmp_path / "shardwork.py").write_text(SHARDED_WORK)

    def spec(limit: str) -> Path:
        path = tmp_path / "sharded.yaml"
        path.write_text(json.dumps({
            "name": "sharded", "work": {"kind": "training", "entrypoint": "shardwork:main",
                                        "params": {"steps": 400, "step_s": 0.1, "every": 10}},
            "request": {"nodes": 2, "cpus": 1, "limit": limit, "grace": "10s"},
            "output": {"kind": "model", "url": str(out), "files": ["seen.json", "model.pt"],
                       "checkpoint": {"every_steps": 10}}}))
        return path

    with queue(tmp_path, {"n1": 0, "n2": 0, "n3": 0, "n4": 0}) as q:
        q.scheduler("--lease", "10")
        q.worker("n1", 0)
        q.worker("n2", 0)
        q.submit(spec("30s"))
        wait_for(lambda: final_manifest(out / "partial") is not None or _failed(q), timeout=300,
                 what="the partial output")
        partial = final_manifest(out / "partial")
        stopped = partial["step"]
        marker = json.loads((out / "checkpoints" / f"step-{stopped}" / MARKER).read_text())
        for node in ("n1", "n2"):  # those machines go away
            stop_group(q.procs.pop(f"worker-{node}"), timeout=20)
        wait_for(lambda: _queue_says(q, "n1", "lost:") and _queue_says(q, "n2", "lost:"), timeout=120,
                 what="n1 and n2 taken for lost")
        q.worker("n3", 0)
        q.worker("n4", 0)
        q.submit(spec("5m"))
        wait_for(lambda: final_manifest(out) is not None or _failed(q), timeout=300, what="the resumed output")
        done = final_manifest(out)
        lead = json.loads((out / "seen.json").read_text())
        member_node = "n4" if lead["node"] == "n3" else "n3"
        member = json.loads((tmp_path / f"scratch-{member_node}" / "sharded" / "member" / "output" / "seen.json")
                            .read_text())
    assert (partial["status"], partial["reason"]) == ("partial", "time_limit") and 0 < stopped < 400
    assert sorted(marker["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert marker["sharded"]["world_size"] == 2
    assert (done["status"], done["step"], done["resumed_from_step"]) == ("completed", 400, stopped)
    assert lead["node"] in ("n3", "n4") and (lead["start"], member["start"]) == (stopped, stopped)
    expected = _sharded_reference(400)
    assert torch.equal(torch.load(out / "model.pt"), expected)  # to the bit, as if never stopped
    assert (lead["local"], member["local"]) == (expected[:3].tolist(), expected[3:].tolist())


def _queue_says(q, node: str, words: str) -> bool:
    """Whether ``e31 queue``'s row of ``node`` holds ``words``."""
    import subprocess

    done = subprocess.run([q.exe, "queue", "--pool", str(q.pool)], capture_output=True, text=True, cwd=q.root)
    return any(line.split()[:1] == [node] and words in line for line in done.stdout.splitlines())


def test_a_gang_cancelled_while_one_member_has_not_started_stops_every_rank_and_starts_nothing_late(
        prefect_api, tmp_path):
    """A 3-node gang whose third node's worker is frozen (SIGSTOP, still within its lease) when the gang
    is placed: the lead and rank 1 start their work, which waits in ``init_process_group`` for rank 2.
    ``e31 cancel`` then stops both started ranks (a partial output, reason ``cancelled``), and once the
    frozen worker runs again it starts nothing for the cancelled run: no work of the job is left on any
    node."""
    import os
    import signal
    import subprocess
    import time

    from prefect.client.orchestration import get_client

    out = tmp_path / "out" / "gang"
    with queue(tmp_path, {"n1": 0, "n2": 0, "n3": 0}) as q:
        spec = gang_spec(tmp_path, out, 300, 0.1, nodes=3, grace="3s")
        q.scheduler()
        for node in ("n1", "n2", "n3"):
            q.worker(node, 0)
        wait_for(lambda: all(_queue_says(q, n, "  heard ") for n in ("n1", "n2", "n3")) and
                 "started!" in (q.root / "worker-n3.log").read_text(), timeout=60, what="the three workers heard")
        frozen = q.procs["worker-n3"]
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            run_id = q.submit(spec).split("flow run ")[1].split()[0]
            member = tmp_path / "scratch-n2" / "gang" / "member" / "run" / "child.json"
            with get_client(sync_client=True) as client:
                wait_for(lambda: member.exists() and client.read_flow_run(run_id).state.name == "Running"
                         or _failed(q), timeout=180, what="the lead and rank 1 started")
                placement = client.read_flow_run(run_id).parameters["placement"]
                started = [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(int(p), str(member))]
                cancel = subprocess.run([q.exe, "cancel", "gang", "--pool", str(q.pool)], capture_output=True,
                                        text=True, cwd=q.root)
                assert cancel.returncode == 0, cancel
                wait_for(lambda: client.read_flow_run(run_id).state.is_final(), timeout=120,
                         what="the cancelled run's end")
                run = client.read_flow_run(run_id)
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
            resumed = time.monotonic()
        manifest = final_manifest(out / "partial")
        wait_for(lambda: (_heard_s(q, "n3") or 1e9) <= time.monotonic() - resumed, timeout=60,
                 what="n3's worker heard again after it runs again")  # its loop has run: members are polled there
        left = [int(p) for p in os.listdir("/proc") if p.isdigit() and
                any(_cmdline_has(int(p), str(tmp_path / f"scratch-{n}" / "gang")) for n in ("n1", "n2", "n3"))]
        n3_work = (tmp_path / "scratch-n3" / "gang" / "member" / "run" / "child.json").exists()
    assert (placement["e31_node"], [m for m, _ in placement["e31_gang"]]) == ("n1", ["n2", "n3"])
    assert len(started) == 1  # rank 1's work ran
    assert run.state.type.value == "CANCELLED", run.state
    assert (manifest["status"], manifest["reason"]) == ("partial", "cancelled")
    assert left == [] and not n3_work  # nothing of the job runs anywhere; rank 2's work never started


def _heard_s(q, node: str) -> int | None:
    """Seconds since ``node``'s worker was heard, as ``e31 queue`` says (None: it says otherwise)."""
    import re
    import subprocess

    done = subprocess.run([q.exe, "queue", "--pool", str(q.pool)], capture_output=True, text=True, cwd=q.root)
    for line in done.stdout.splitlines():
        found = re.search(r"  heard (\d+) s ago", line)
        if line.split()[:1] == [node] and found:
            return int(found.group(1))
    return None
