"""The handover rules without a server: which running job a waiting run may
be handed over behind (e31.flows.queue.record.handover_lead), and how the
snapshot counts a handed-over run (e31.flows.queue.snapshot), on real
Prefect flow run objects and job specs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.states import Pending, Running, Scheduled, State

from e31.flows.placement import Node, Placement, RunningJob
from e31.flows.queue import AFTER_VAR, handover_lead
from e31.flows.queue.handover import flow_process_alive, wait_for_run_ahead
from e31.flows.queue.corrections import chain_handovers
from e31.flows.queue.snapshot import Snapshot
from e31.specs import parse_spec

NOW = 1_800_000_000.0


def _spec(name: str, memory: str | None = None):
    request = {"gpus": 2, "cpus": 1, "duration": "30s", **({"memory": memory} if memory else {})}
    return parse_spec({"name": name, "work": {"kind": "simulation", "command": ["true"]}, "request": request,
                       "output": {"kind": "results", "url": "/tmp/x", "files": ["r"]}})


def _snap(lead_state=None, lead_end: float = NOW + 5, lead_memory: int = 0, follower_memory: str | None = None):
    lead, waiting = str(uuid.uuid4()), str(uuid.uuid4())
    snap = Snapshot(now=NOW, nodes=[Node("n1", 4, 8, 2**34)])
    snap.runs[lead] = FlowRun(id=lead, flow_id=uuid.uuid4(), name="ahead", state=lead_state or Running())
    snap.runs[waiting] = FlowRun(id=waiting, flow_id=uuid.uuid4(), name="next", state=Scheduled())
    snap.specs[lead], snap.specs[waiting] = _spec("ahead"), _spec("next", follower_memory)
    snap.running.append(RunningJob(lead, "n1", (0, 1), 1, lead_memory, NOW - 20, lead_end))
    return snap, lead, waiting


def _wait(job: str, start: float, devices=(0, 1), node="n1", reserved=True) -> Placement:
    return Placement(job, "wait", node, devices, 1, start, start + 30, "planned", reserved)


def test_a_waiting_run_is_handed_over_behind_the_job_whose_devices_it_is_planned_on():
    snap, lead, waiting = _snap()
    assert handover_lead(snap, _wait(waiting, NOW + 5), 10, set()).id == lead
    assert handover_lead(snap, _wait(waiting, NOW + 5.9), 10, set()).id == lead  # within 1 s of its planned end


def test_a_run_is_handed_over_behind_a_job_only_placed_or_starting():
    """A job ahead that is ``Placed`` or ``Pending`` (its flow process not
    started yet) takes a run behind it too: that run's flow process starts
    beside it, not after a later tick sees it ``Running`` (with 3 s jobs on
    a busy server that came after the work ended, 1-3 s of an idle node)."""
    for state in (Scheduled(name="Placed"), Pending()):
        snap, lead, waiting = _snap(lead_state=state)
        assert handover_lead(snap, _wait(waiting, NOW + 5), 10, set()).id == lead
    queued, _, waiting = _snap(lead_state=Scheduled(name="Queued"))
    assert handover_lead(queued, _wait(waiting, NOW + 5), 10, set()) is None  # back in the queue: not on its node


def test_the_wait_behind_a_placed_job_goes_on_until_it_runs_and_ends_if_it_is_queued_again(monkeypatch):
    """Behind a job ahead with no flow process yet (``Placed``, no pid),
    the wait goes on (it is not taken for gone); when that job crashes
    before it starts and is queued again, the wait ends: it will not run
    here first."""
    import e31.flows.queue.handover as handover

    monkeypatch.setattr(handover, "API_EVERY_S", 0.01)
    monkeypatch.setattr(handover, "handover_dir", lambda: Path(tempfile.mkdtemp()))
    ahead = uuid.uuid4()
    states = [Scheduled(name="Placed")] * 20 + [Scheduled(name="Queued")]
    reads = []

    class _Api:
        def read_flow_run(self, key):
            reads.append(key)
            return FlowRun(id=ahead, flow_id=uuid.uuid4(), name="ahead", state=states[min(len(reads), len(states)) - 1])

    said = []
    wait_for_run_ahead(str(ahead), stop=lambda: len(reads) > 100, say=said.append, client=_Api())
    assert len(reads) == 21  # waited through 20 reads of it Placed; ended at the first Queued
    assert said == [f"handed over behind ahead ({str(ahead)[:8]}): the work starts once it has returned its output"]


def test_no_handover_outside_the_rules():
    snap, lead, waiting = _snap()
    assert handover_lead(snap, _wait(waiting, NOW + 5), 0, set()) is None  # turned off
    assert handover_lead(snap, _wait(waiting, NOW + 5), 4, set()) is None  # the end is 5 s away, the window 4 s
    assert handover_lead(snap, _wait(waiting, NOW + 5), 10, {lead}) is None  # a run is behind it already
    assert handover_lead(snap, _wait(waiting, NOW + 5, devices=(1, 2)), 10, set()) is None  # device 2 is not its
    assert handover_lead(snap, _wait(waiting, NOW + 8), 10, set()) is None  # planned after another job's end
    assert handover_lead(snap, _wait(waiting, NOW + 5, node="n2"), 10, set()) is None
    assert handover_lead(snap, _wait(waiting, NOW + 5, reserved=False), 10, set()) is None  # an estimate only
    cancelling, _, waiting2 = _snap(lead_state=State(type=StateType.CANCELLING, name="Cancelling"))
    assert handover_lead(cancelling, _wait(waiting2, NOW + 5), 10, set()) is None  # the job ahead is being stopped
    over, _, waiting4 = _snap()
    over.overbooked["n1"] = "2 runs hold CPUs 2 of its 1, memory 0 B of its 16 GiB"
    assert handover_lead(over, _wait(waiting4, NOW + 5), 10, set()) is None  # what its runs hold is a guess
    small, _, waiting3 = _snap(follower_memory="1GiB")
    assert handover_lead(small, _wait(waiting3, NOW + 5), 10, set()) is None  # more memory than the job ahead holds


def test_an_overrunning_job_ahead_counts_as_ending_in_one_second():
    snap, lead, waiting = _snap(lead_end=NOW - 30)  # past its planned end: the planner says now + 1 s
    assert handover_lead(snap, _wait(waiting, NOW + 1), 10, set()).id == lead


def test_a_handed_over_run_holds_nothing_of_its_own_while_the_job_ahead_runs():
    snap, lead, waiting = _snap(lead_end=NOW + 5)
    snap.runs[waiting] = FlowRun(id=waiting, flow_id=uuid.uuid4(), name="next", state=Running(),
                                 parameters={"placement": {AFTER_VAR: lead}})
    snap.running.append(RunningJob(waiting, "n1", (0, 1), 1, 0, NOW - 2, NOW + 28))
    chain_handovers(snap)
    assert snap.behind == {waiting: lead}
    assert snap.running == [RunningJob(lead, "n1", (0, 1), 1, 0, NOW - 20, NOW + 5 + 30)]  # its end + the next's 30 s
    snap2, lead2, waiting2 = _snap()  # the job ahead has ended: the handed-over run holds its own placement
    snap2.running.clear()
    snap2.runs[waiting2] = FlowRun(id=waiting2, flow_id=uuid.uuid4(), name="next", state=Running(),
                                   parameters={"placement": {AFTER_VAR: lead2}})
    snap2.running.append(RunningJob(waiting2, "n1", (0, 1), 1, 0, NOW - 2, NOW + 28))
    chain_handovers(snap2)
    assert snap2.behind == {} and [r.id for r in snap2.running] == [waiting2]


def test_the_wait_ends_when_the_process_of_the_run_ahead_is_gone():
    """The run ahead's flow process is checked by its pid and its
    PREFECT__FLOW_RUN_ID (a pid reused by another process does not count)."""
    ahead = uuid.uuid4()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "PREFECT__FLOW_RUN_ID": str(ahead)})
    try:
        run = FlowRun(id=ahead, flow_id=uuid.uuid4(), name="ahead", state=Running(), infrastructure_pid=str(proc.pid))
        assert flow_process_alive(run)
        other = FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="x", state=Running(),
                        infrastructure_pid=str(proc.pid))
        assert not flow_process_alive(other)  # the pid lives, but it is not that run's process

        class _Api:  # the run as the API would answer it, while its process runs
            def read_flow_run(self, key):
                assert key == str(ahead)
                return run

        said, polls = [], []

        def stop() -> bool:
            polls.append(1)
            if len(polls) == 5:
                proc.kill()
                proc.wait()
            return len(polls) > 400

        waited = wait_for_run_ahead(str(ahead), stop=stop, say=said.append, client=_Api())
    finally:
        proc.kill()
        proc.wait()
    assert 5 <= len(polls) < 400 and waited > 0
    assert said == [f"handed over behind ahead ({str(ahead)[:8]}): the work starts once it has returned its output"]


def test_once_the_job_ahead_has_ended_a_handed_over_run_counts_from_that_end():
    """Its flow process went Running while it waited: its planned end counts
    from the job ahead's end (when its work could begin), not from then."""
    snap, lead, waiting = _snap()
    snap.running.clear()  # the job ahead has ended
    snap.runs[waiting] = FlowRun(id=waiting, flow_id=uuid.uuid4(), name="next", state=Running(),
                                 parameters={"placement": {AFTER_VAR: lead}})
    snap.running.append(RunningJob(waiting, "n1", (0, 1), 1, 0, NOW - 9, NOW - 9 + 30))
    chain_handovers(snap, {lead: NOW - 2})
    assert snap.running == [RunningJob(waiting, "n1", (0, 1), 1, 0, NOW - 2, NOW - 2 + 30)]
    assert snap.behind == {}


def test_a_reason_names_the_run_handed_over_behind_the_one_it_waits_for():
    from e31.flows.queue import humane

    snap, lead, waiting = _snap()
    snap.behind[waiting] = lead
    assert humane(f"earliest start 10:00:00 UTC on n1, after job {lead} ends", snap) == \
        f"earliest start 10:00:00 UTC on n1, after job next ({waiting[:8]}) ends"


def test_the_leftover_work_of_a_run_is_found_by_its_run_id_and_its_work_token_and_killed():
    from e31.flows.queue.handover import end_leftover_work, leftover_work

    run = str(uuid.uuid4())
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    work = subprocess.Popen(sleep, env={**os.environ, "PREFECT__FLOW_RUN_ID": run, "E31_WORK_TOKEN": "t1"})
    flow = subprocess.Popen(sleep, env={**os.environ, "PREFECT__FLOW_RUN_ID": run})  # the flow process: no token
    other = subprocess.Popen(sleep, env={**os.environ, "PREFECT__FLOW_RUN_ID": str(uuid.uuid4()),
                                         "E31_WORK_TOKEN": "t2"})  # another run's work
    try:
        assert leftover_work(run) == [work.pid]
        assert end_leftover_work(run) == [work.pid]
        assert work.wait(timeout=10) == -9
        assert flow.poll() is None and other.poll() is None
        assert leftover_work(run) == [] and end_leftover_work(run) == []
    finally:
        for proc in (work, flow, other):
            proc.kill()
            proc.wait()


def test_a_chain_of_three_handed_over_runs_is_held_by_its_first_and_named_by_its_last():
    """Chains, in any list order.  The second half is what bench_queue met with
    10 s jobs: a run handed over behind one that was itself handed over behind
    a run that has ended, listed before it; every tick failed on it."""
    from e31.flows.queue import humane

    snap, a, b = _snap(lead_end=NOW + 5)
    c = str(uuid.uuid4())
    snap.runs[b] = FlowRun(id=b, flow_id=uuid.uuid4(), name="next", state=Running(),
                           parameters={"placement": {AFTER_VAR: a}})
    snap.runs[c] = FlowRun(id=c, flow_id=uuid.uuid4(), name="third", state=Running(),
                           parameters={"placement": {AFTER_VAR: b}})
    snap.specs[c] = _spec("third")
    # the third first in the list, then the second: the order the failing ticks saw
    snap.running += [RunningJob(c, "n1", (0, 1), 1, 0, NOW - 1, NOW + 29), RunningJob(b, "n1", (0, 1), 1, 0, NOW - 2,
                                                                                      NOW + 28)]
    chain_handovers(snap)
    assert snap.behind == {c: b, b: a}
    assert snap.running == [RunningJob(a, "n1", (0, 1), 1, 0, NOW - 20, NOW + 5 + 30 + 30)]
    assert humane(f"earliest start 10:01:05 UTC on n1, after job {a} ends", snap) == \
        f"earliest start 10:01:05 UTC on n1, after job third ({c[:8]}) ends"
    # the first has ended: the second counts from its end, and holds the third's time too
    snap2, a2, b2 = _snap()
    snap2.running.clear()
    snap2.runs[b2] = FlowRun(id=b2, flow_id=uuid.uuid4(), name="next", state=Running(),
                             parameters={"placement": {AFTER_VAR: a2}})
    snap2.runs[c] = FlowRun(id=c, flow_id=uuid.uuid4(), name="third", state=Running(),
                            parameters={"placement": {AFTER_VAR: b2}})
    snap2.specs[c] = _spec("third")
    snap2.running += [RunningJob(c, "n1", (0, 1), 1, 0, NOW - 1, NOW + 29), RunningJob(b2, "n1", (0, 1), 1, 0,
                                                                                       NOW - 9, NOW - 9 + 30)]
    chain_handovers(snap2, {a2: NOW - 2})
    assert snap2.behind == {c: b2}
    assert snap2.running == [RunningJob(b2, "n1", (0, 1), 1, 0, NOW - 2, NOW - 2 + 30 + 30)]


def test_once_the_process_ahead_is_seen_alive_here_the_api_is_read_every_ten_seconds():
    """The run ahead's flow run is read from the API at the first turn; once
    its flow process is seen alive on this machine, the next read is
    API_ALIVE_EVERY_S (10 s) later, not API_EVERY_S (2 s): over a 4.5 s wait
    that ends with the process, one read (the old pace made three)."""
    from e31.flows.queue import handover

    ahead = uuid.uuid4()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "PREFECT__FLOW_RUN_ID": str(ahead)})
    reads = []
    try:
        run = FlowRun(id=ahead, flow_id=uuid.uuid4(), name="ahead", state=Running(), infrastructure_pid=str(proc.pid))

        class _Api:  # the run as the API would answer it, while its process runs
            def read_flow_run(self, key):
                reads.append(key)
                return run

        started = time.monotonic()

        def stop() -> bool:
            if time.monotonic() - started >= 4.5 and proc.poll() is None:
                proc.kill()
                proc.wait()
            return time.monotonic() - started > 60

        waited = wait_for_run_ahead(str(ahead), stop=stop, say=lambda line: None, client=_Api())
    finally:
        proc.kill()
        proc.wait()
    assert reads == [str(ahead)]
    assert 4.5 <= waited < 10
    assert (handover.API_EVERY_S, handover.API_ALIVE_EVERY_S) == (2.0, 10.0)


def _cut_record(scratch: Path, job: str, run_id: str) -> Path:
    """The pending record a flow process killed in its return leaves (e31.tasks.pending.recorded_return)."""
    from e31.tasks.pending import IN_PROGRESS, PENDING

    (scratch / job).mkdir(parents=True, exist_ok=True)
    record = scratch / job / PENDING
    record.write_text(json.dumps({"error": IN_PROGRESS, "target": {"run_id": run_id}}))
    return record


@pytest.mark.parametrize("worker_does", ["finishes", "gives-up"])
def test_behind_a_run_killed_in_its_return_the_wait_lasts_until_its_worker_has_finished_it(
        monkeypatch, tmp_path, worker_does):
    """The run ahead's flow process killed during its return must not end
    the wait at once, or the work behind it runs beside the worker's
    delivery of that return.  The wait goes on past the process's end
    while the run ahead's cut return is pending in the node's scratch,
    through Prefect's fresh ``Crashed`` and the worker's
    ``Pending`` (``Returning``): ``finishes``, until the record is gone
    (delivered); ``gives-up``, until the worker crashed the run it could
    not finish (a ``Crashed`` older than SETTLE_S, the record kept)."""
    from datetime import datetime, timedelta, timezone

    from prefect.states import Crashed

    from e31.flows.queue import handover

    monkeypatch.setattr(handover, "RETURNING_READ_S", 0.01, raising=False)
    monkeypatch.setenv("E31_SCRATCH", str(tmp_path))
    ahead = uuid.uuid4()
    record = _cut_record(tmp_path, "ahead-job", str(ahead))
    _cut_record(tmp_path, "other-job", str(uuid.uuid4()))  # another run's cut return: not waited for
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "PREFECT__FLOW_RUN_ID": str(ahead)})
    spec = {"name": "ahead-job"}
    timeline: list[str] = []
    old = datetime.now(timezone.utc) - timedelta(seconds=10)
    states = {"alive": Running(), "returning": Pending(name="Returning"),
              "finishes": State(type=StateType.COMPLETED, name="Completed"),
              "gives-up": Crashed(timestamp=old)}

    class _Api:
        def read_flow_run(self, key):
            phase = timeline[-1] if timeline else "alive"
            return FlowRun(id=ahead, flow_id=uuid.uuid4(), name="ahead", state=states[phase],
                           parameters={"spec": spec}, infrastructure_pid=str(proc.pid))

    polls = []

    def stop() -> bool:  # the run ahead's end, turn by turn
        polls.append(1)
        if len(polls) == 5:
            proc.kill()
            proc.wait()
            states["fresh"] = Crashed()  # Prefect's worker's, now
            timeline.append("fresh")
        elif len(polls) == 15:
            timeline.append("returning")
        elif len(polls) == 80:
            timeline.append(worker_does)
            if worker_does == "finishes":
                record.unlink()
        return len(polls) > 400

    said = []
    try:
        wait_for_run_ahead(str(ahead), stop=stop, say=said.append, client=_Api())
    finally:
        proc.kill()
        proc.wait()
    assert 80 <= len(polls) <= 83  # not at the process's end (5), nor at the fresh crash: once the return ended
    assert said == [f"handed over behind ahead ({str(ahead)[:8]}): the work starts once it has returned its output",
                    f"ahead ({str(ahead)[:8]}) was cut during the return of its output; the work starts once its "
                    "worker has finished that return"]


def test_the_release_of_the_run_ahead_ends_the_wait_at_once_while_its_return_record_is_still_there(
        monkeypatch, tmp_path):
    """After a plain handover the waiting run must not log ``... was cut
    during the return of its output`` and wait on.  A run releases the
    node (removes the marker) once its output is at the destination, a
    moment before it removes its return's pending record; the wait must
    not take that record for a cut return.  The release ends the wait at
    once, and only a run ahead whose process is gone (or whose state is
    final) is checked for a cut return."""
    from e31.flows.queue.handover import release

    monkeypatch.setenv("E31_SCRATCH", str(tmp_path))
    ahead = uuid.uuid4()
    record = _cut_record(tmp_path, "ahead-job", str(ahead))  # the return's record, as during any return
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "PREFECT__FLOW_RUN_ID": str(ahead)})

    class _Api:
        def read_flow_run(self, key):
            return FlowRun(id=ahead, flow_id=uuid.uuid4(), name="ahead", state=Running(),
                           parameters={"spec": {"name": "ahead-job"}}, infrastructure_pid=str(proc.pid))

    polls, said = [], []

    def stop() -> bool:
        polls.append(1)
        if len(polls) == 5:
            release(str(ahead))  # what run_job does once the output is returned
        return len(polls) > 100

    try:
        wait_for_run_ahead(str(ahead), stop=stop, say=said.append, client=_Api())
    finally:
        proc.kill()
        proc.wait()
    assert len(polls) == 5  # the turn that saw the marker gone (the old code waited on: 101)
    assert said == [f"handed over behind ahead ({str(ahead)[:8]}): the work starts once it has returned its output"]
    assert record.exists() and not (tmp_path / ".handover" / str(ahead)).exists()


def test_a_victim_queued_again_behind_the_run_that_preempted_it_ends_that_run_s_wait(monkeypatch):
    """The run placed by a preemption waits for its victim; a victim that returned its output before
    that wait left its marker, and was queued again and handed over behind that run, has a live flow
    process (its new attempt, waiting): its placement naming the waiting run ends the wait at once,
    where the two would otherwise wait for each other."""
    import e31.flows.queue.handover as handover

    monkeypatch.setattr(handover, "API_EVERY_S", 0.01)
    monkeypatch.setattr(handover, "handover_dir", lambda: Path(tempfile.mkdtemp()))
    ahead, me = uuid.uuid4(), str(uuid.uuid4())
    alive = FlowRun(id=ahead, flow_id=uuid.uuid4(), name="victim", state=Running(), infrastructure_pid=str(os.getpid()),
                    parameters={"placement": {"e31_node": "n1", AFTER_VAR: me}})
    monkeypatch.setattr(handover, "flow_process_alive", lambda run: True)
    reads = []

    class _Api:
        def read_flow_run(self, key):
            reads.append(key)
            return alive

    wait_for_run_ahead(str(ahead), stop=lambda: len(reads) > 50, say=lambda line: None, client=_Api(), me=me)
    assert len(reads) == 1  # ended at its first read
    alive.parameters["placement"][AFTER_VAR] = str(uuid.uuid4())  # behind another run: still ahead of this one
    reads.clear()
    wait_for_run_ahead(str(ahead), stop=lambda: len(reads) > 5, say=lambda line: None, client=_Api(), me=me)
    assert len(reads) == 6
    assert handover.attempt_over(alive, me, "n1") is None
    assert handover.attempt_over(alive, me, "n2") == "moved"  # placed on n1, this wait is on n2
