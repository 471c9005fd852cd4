"""The live queue's preemption pieces that need no server (:mod:`e31.flows.queue.preempt`): which
running runs may be victims, what a run placed by a preemption holds while its victims still run,
the placement record that carries a run's preemptions across attempts, and the states and manifest
words of a preemption.  The end-to-end behaviour is in tests/deployments/test_preemption_live.py."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from types import SimpleNamespace

from e31.flows.placement import Node, Placement, QueuedJob, RunningJob
from e31.flows.queue import preempt
from e31.flows.queue.cache import kept
from e31.flows.queue.snapshot import retries_used
from e31.specs import JobSpec
from e31.states import manifest_state
from e31.tasks.placement_record import PlacementRecord
from e31.flows.cancelhook import stopped_by_cancel

SPEC = {"name": "train", "work": {"kind": "training", "command": ["true"]},
        "request": {"gpus": 1, "cpus": 1, "limit": "1h"},
        "output": {"kind": "model", "url": "/tmp/out", "files": ["m.pt"], "checkpoint": {"every": "5m"}}}


def _state(kind: str, name: str, message: str = "") -> SimpleNamespace:
    return SimpleNamespace(type=SimpleNamespace(value=kind), name=name, message=message,
                           timestamp=datetime.fromtimestamp(1000.0, timezone.utc))


def _run(kind: str = "RUNNING", name: str = "Running", placement: dict | None = None, tags=(), run_count: int = 1,
         key: str = "v1") -> SimpleNamespace:
    return SimpleNamespace(id=key, state=_state(kind, name), parameters={"spec": SPEC, "placement": placement or {}},
                           tags=list(tags), run_count=run_count, job_variables=None)


def test_the_placement_record_carries_victims_preemptions_and_attained_service():
    record = PlacementRecord(node="n1", devices=(0,), cpus=1, attempt=2, after="a", unstarted=1,
                             victims=("v1", "v2"), preempted=(100.0, 200.5), attained_s=3600.25, lost_s=12.5)
    value = record.parameter()
    assert value["e31_preempts"] == ["v1", "v2"] and value["e31_preempted"] == [100.0, 200.5]
    assert (value["e31_attained_s"], value["e31_lost_s"]) == (3600.25, 12.5)
    assert PlacementRecord.from_parameter(value) == record
    assert record.waits_for() == ("a", "v1", "v2")
    assert record.kept() == PlacementRecord(attempt=2, unstarted=1, preempted=(100.0, 200.5), attained_s=3600.25,
                                            lost_s=12.5)
    # a value of the wrong type reads as not set
    bad = PlacementRecord.from_parameter({"e31_preempts": "v1", "e31_preempted": [True, -1, "x", 5],
                                          "e31_attained_s": "lots"})
    assert (bad.victims, bad.preempted, bad.attained_s) == ((), (5.0,), 0.0)
    assert PlacementRecord().parameter() == {}


def test_only_a_preemptible_run_at_its_work_may_be_a_victim():
    spec = JobSpec.model_validate(SPEC)
    assert preempt.victim_fields(spec, _run(), waiting=False)["preemptible"] is True
    assert preempt.victim_fields(spec, _run("PENDING", "Pending"), waiting=False)["preemptible"] is False
    assert preempt.victim_fields(spec, _run("CANCELLING", "Preempting"), waiting=False)["preemptible"] is False
    assert preempt.victim_fields(spec, _run(), waiting=True)["preemptible"] is False
    ended = _run(tags=["e31-work-ended:1:2026-12-06T00:00:00Z"])
    assert preempt.victim_fields(spec, ended, waiting=False)["preemptible"] is False  # its output is on its way
    deadline = JobSpec.model_validate({**SPEC, "request": {**SPEC["request"], "deadline_within": "2h"}})
    assert preempt.victim_fields(deadline, _run(), waiting=False)["preemptible"] is False
    declared = JobSpec.model_validate({**SPEC, "request": {**SPEC["request"], "preemptible": False}})
    assert preempt.victim_fields(declared, _run(), waiting=False)["preemptible"] is False


def test_the_checkpoint_tag_of_the_current_attempt_is_the_work_a_preemption_loses():
    spec = JobSpec.model_validate(SPEC)
    run = _run(tags=["e31-checkpoint:1:900", "other"], run_count=2)  # an earlier attempt's: not this one's
    assert preempt.checkpoint_at(run) is None
    run = _run(tags=["e31-checkpoint:2:1500"], run_count=2,
               placement={"e31_preempted": [700.0], "e31_attained_s": 50.0})
    fields = preempt.victim_fields(spec, run, waiting=False)
    assert (fields["checkpoint_at"], fields["preemptions"], fields["attained_s"], fields["no_duration"]) == \
        (1500.0, (700.0,), 50.0, True)
    assert preempt.checkpoint_at(_run(tags=["e31-checkpoint:1:soon"])) is None


def test_a_run_waits_for_its_victims_until_its_work_started_tag():
    placed = {"e31_node": "n1", "gpu_devices": [0], "cpus": 1, "e31_preempts": ["v9"]}
    assert preempt.waiting(_run(placement=placed)) is True
    assert preempt.waiting(_run(placement=placed, tags=["e31-work-started:1"])) is False
    assert preempt.waiting(_run(placement=placed, tags=["e31-work-started:1"], run_count=2)) is True
    assert preempt.waiting(_run(placement={"e31_node": "n1"})) is False


def test_a_run_placed_by_a_preemption_holds_only_what_its_victims_do_not():
    victim = RunningJob("v1", "n1", (0, 1), 4, 2**30, 0.0, 5000.0, preemptible=True)
    other = RunningJob("o1", "n1", (2,), 1, 0, 0.0, 5000.0, preemptible=True)
    placed = RunningJob("p1", "n1", (0, 1, 3), 6, 2**31, 100.0, 900.0)
    runs = {"v1": _run(key="v1"), "o1": _run(key="o1"),
            "p1": _run(key="p1", placement={"e31_node": "n1", "e31_preempts": ["v1", "gone"]})}
    snap = SimpleNamespace(running=[victim, other, placed], runs=runs)
    preempt.hold_behind_victims(snap)
    assert snap.running[2] == RunningJob("p1", "n1", (3,), 2, 2**30, 100.0, 900.0, preemptible=False)
    snap = SimpleNamespace(running=[other, placed], runs=runs)  # its victim ended: it holds its whole placement
    preempt.hold_behind_victims(snap)
    assert snap.running[1] == placed


def test_a_run_with_a_run_handed_over_behind_it_or_on_an_overbooked_node_is_never_a_victim():
    nodes = [Node("n1", 1, 4, 2**32), Node("n2", 1, 4, 2**32)]
    running = [RunningJob("a", "n1", (0,), 1, 0, 0.0, 9000.0, preemptible=True),
               RunningJob("b", "n2", (0,), 1, 0, 0.0, 9000.0, preemptible=True)]
    job = QueuedJob("d", "urgent", 1, 1, 0, 0.0, 60.0, 60.0, deadline=500.0, runtime_source="duration")
    wait = [Placement("d", "wait", "n1", (0,), 1, 9000.0, 9060.0, "waits")]
    snap = SimpleNamespace(running=running, queued=[job], nodes=nodes, now=1000.0 - 700, behind={}, overbooked={})
    rules = preempt.PreemptionRules(min_run_s=10.0)
    assert [p.preemption.victims for p in preempt.plan(snap, wait, rules)] == [("a",)]
    snap.behind = {"f": "a"}
    assert [p.preemption.victims for p in preempt.plan(snap, wait, rules)] == [("b",)]
    snap.overbooked = {"n2": "2 runs hold ..."}
    assert preempt.plan(snap, wait, rules) == []


def test_a_preempted_run_stays_in_the_queue_s_view_and_uses_none_of_its_retries():
    assert kept(_state("CANCELLED", "Preempted")) is True
    assert kept(_state("CANCELLED", "Cancelled")) is False
    assert kept(_state("RUNNING", "Running")) is True
    assert preempt.is_preempted(_run("CANCELLED", "Preempted")) is True
    assert preempt.is_preempting(_state("CANCELLING", "Preempting")) is True
    assert preempt.is_preempting(_state("CANCELLING", "Cancelling")) is False
    run = _run("CRASHED", "Crashed", placement={"e31_unstarted": 1, "e31_preempted": [10.0, 20.0]}, run_count=4)
    assert retries_used(run) == 1


def test_a_preempted_manifest_ends_its_run_preempted_and_counts_as_a_cancel_s_stop():
    head = {"status": "partial", "reason": "preempted", "message": "stopped early (preempted)"}
    assert manifest_state(head) == {"type": "CANCELLED", "name": "Preempted", "message": "stopped early (preempted)"}
    assert stopped_by_cancel(head) is True


def test_a_nudge_makes_the_reader_read_at_once(tmp_path, monkeypatch):
    from e31.tasks.supervisor import cancel

    monkeypatch.setattr(cancel.tempfile, "gettempdir", lambda: str(tmp_path))
    reader = object.__new__(cancel._Reader)  # its wait alone, with no thread reading an API
    reader.flow_run_id, reader.every, reader.done = "r1", 10.0, False
    reader.wake = __import__("threading").Event()
    assert cancel.nudge("r1") and cancel.nudge_path("r1").exists()
    started = time.monotonic()
    reader._wait()
    assert time.monotonic() - started < 1.0 and not cancel.nudge_path("r1").exists()
    reader.every = 0.3
    started = time.monotonic()
    reader._wait()  # not nudged: the whole interval
    assert time.monotonic() - started >= 0.3


def test_the_manifest_counts_the_run_s_preemptions_and_the_work_they_threw_away():
    from e31.tasks.deliver import ReturnTarget, preempted_so_far
    from e31.tasks.outcome import RunOutcome

    target = ReturnTarget(job="j", run_id="r", output_dir="/o", output_url="/u", declared=[], gpus=1, cpus=1,
                          spec_sha256="", preemptions=2, lost_s=40.0)
    stopped = RunOutcome(reason="preempted", exit_code=0, run_s=100.0, stop_requested_at=1100.0,
                         work_started_at=1000.0, checkpoint_at=1090.5)
    assert preempted_so_far(target, stopped, "preempted") == {"preemptions": 3, "lost_s": 49.5}
    fresh = RunOutcome(reason="preempted", exit_code=0, run_s=5.0, stop_requested_at=1005.0, work_started_at=1000.0)
    assert preempted_so_far(target, fresh, "preempted") == {"preemptions": 3, "lost_s": 45.0}  # no checkpoint yet
    staging = RunOutcome(reason="preempted", exit_code=None, run_s=0.0)  # stopped before its work started
    assert preempted_so_far(target, staging, "preempted") == {"preemptions": 3, "lost_s": 40.0}
    assert preempted_so_far(target, stopped, "finished") == {"preemptions": 2, "lost_s": 40.0}


def test_e31_queue_says_a_run_is_being_preempted():
    from e31.deployments.runwords import holding

    assert holding(_state("CANCELLING", "Preempting")).startswith("preempting: its work is being stopped")
    assert holding(_state("CANCELLING", "Cancelling")).startswith("cancelling: ")


def test_the_work_lost_is_read_from_the_current_attempt_s_tag():
    assert preempt.lost_so_far(_run(tags=["e31-lost-s:2:41.5"], run_count=2)) == 41.5
    assert preempt.lost_so_far(_run(tags=["e31-lost-s:1:41.5"], run_count=2)) is None  # an earlier attempt's
    assert preempt.lost_so_far(_run(tags=["e31-lost-s:1:many"])) is None


def test_a_run_cancelled_while_placed_for_an_attempt_that_never_started_is_ended_by_the_scheduler():
    """A run queued again after an earlier attempt keeps that attempt's infrastructure pid, so the
    server leaves its cancel ``Cancelling``: once that has lasted UNSTARTED_CANCEL_S with no new
    ``Running`` (its run_count is the one its placement counted), the scheduler ends it."""
    from e31.flows.queue.snapshot import UNSTARTED_CANCEL_S, _cancelled_unstarted

    placed = {"e31_node": "n1", "gpu_devices": [0], "cpus": 1, "e31_attempt": 1}
    at = 1000.0  # the state's time (_state)
    assert _cancelled_unstarted(_run("CANCELLING", "Cancelling", placed, run_count=1), at + UNSTARTED_CANCEL_S)
    assert not _cancelled_unstarted(_run("CANCELLING", "Cancelling", placed, run_count=1), at + 1.0)  # may be starting
    assert not _cancelled_unstarted(_run("CANCELLING", "Cancelling", placed, run_count=2), at + 600)  # it started
    assert not _cancelled_unstarted(_run("CANCELLING", "Cancelling", {**placed, "e31_attempt": 0}, run_count=0),
                                    at + 600)  # a first attempt: its worker's runner ends that cancel


class _Writes:
    """The scheduler's writer, recording: every write succeeds."""

    def __init__(self, states):
        self.client = SimpleNamespace(read_flow_run_states=lambda key: states)
        self.written: list = []

    def state(self, key, state, check=True, force=True):
        self.written.append((key, state.type.value, state.name, state.message))
        return True

    def place(self, key, run, record, check=True):
        self.written.append((key, "placement", record))
        return True


def _logs():
    return SimpleNamespace(lines=[], add=lambda key, line: None)


def test_a_preempted_run_cancelled_while_it_stopped_is_not_queued_again():
    from datetime import timedelta

    t0 = datetime.fromtimestamp(1000.0, timezone.utc)

    def at(seconds, kind, name, message=""):
        return SimpleNamespace(type=SimpleNamespace(value=kind), name=name, message=message,
                               timestamp=t0 + timedelta(seconds=seconds))

    history = [at(0, "RUNNING", "Running"), at(50, "CANCELLING", "Preempting", "preempted by urgent (1a2b3c4d)"),
               at(52, "CANCELLING", "Cancelling", "cancel requested (e31 cancel)")]
    victim = _run("CANCELLED", "Preempted", {"e31_node": "n1", "e31_attempt": 0})
    victim.state = at(55, "CANCELLED", "Preempted", "preempted by urgent (1a2b3c4d); returned step 4 (partial)")
    snap = SimpleNamespace(now=1060.0, preempted=["v1"], runs={"v1": victim}, specs={"v1": JobSpec.model_validate(SPEC)})
    cancelled, counts = _Writes(history), {}
    preempt.requeue(cancelled, snap, _logs(), counts)
    assert cancelled.written == [("v1", "CANCELLED", "Cancelled", "cancelled while it was being preempted (cancel "
                                  "requested (e31 cancel)); preempted by urgent (1a2b3c4d); returned step 4 (partial)")]
    assert counts == {"cancel": 1}
    requeued, counts = _Writes(history[:2]), {}
    preempt.requeue(requeued, snap, _logs(), counts)
    assert [w[1] for w in requeued.written] == ["placement", "SCHEDULED"]  # the record first
    record = requeued.written[0][2]  # the attempt that ran (run_count): a cancel while placed again is then seen
    assert (record.attempt, record.preempted, record.attained_s, record.lost_s) == (1, (1055.0,), 55.0, 50.0)
    assert counts == {"requeued": 1}


def test_a_requeue_whose_state_write_failed_is_finished_by_the_next_tick_without_counting_twice():
    """The record is written before the ``Queued`` state: when that state's write fails, the run stays
    ``Preempted`` and the next tick finds this preemption in its record (its end is the last one) and
    writes only the state; when the record's write fails, no state is written and nothing is lost."""
    from datetime import timedelta

    from e31.flows.queue.mapping import PlacementRecord

    t0 = datetime.fromtimestamp(1000.0, timezone.utc)
    history = [SimpleNamespace(type=SimpleNamespace(value="RUNNING"), name="Running", message="",
                               timestamp=t0)]
    counted = PlacementRecord(node="n1", devices=(0,), cpus=1, attempt=1, preempted=(1055.0,), attained_s=55.0,
                              lost_s=50.0).parameter()
    victim = _run("CANCELLED", "Preempted", counted, run_count=1)
    victim.state.timestamp = t0 + timedelta(seconds=55)
    snap = SimpleNamespace(now=1060.0, preempted=["v1"], runs={"v1": victim}, specs={"v1": JobSpec.model_validate(SPEC)})
    again, counts = _Writes(history), {}
    preempt.requeue(again, snap, _logs(), counts)
    assert [w[1] for w in again.written] == ["SCHEDULED"] and counts == {"requeued": 1}

    class _RecordRefused(_Writes):
        def place(self, key, run, record, check=True):
            self.written.append((key, "refused"))
            return False

    fresh = _run("CANCELLED", "Preempted", {"e31_node": "n1", "e31_attempt": 0}, run_count=1)
    fresh.state.timestamp = t0 + timedelta(seconds=55)
    snap.runs = {"v1": fresh}
    refused, counts = _RecordRefused(history), {}
    preempt.requeue(refused, snap, _logs(), counts)
    assert refused.written == [("v1", "refused")] and counts == {}


def test_e31_queue_lists_a_preempted_run_until_it_is_queued_again():
    """Between its Preempted end and the scheduler's requeue (a scheduler stopped meanwhile: until a
    standby takes over), the run is listed, with the preemption's words."""
    from e31.deployments.runwords import job_rows

    victim = _run("CANCELLED", "Preempted", {"e31_node": "n1"})
    victim.state.message = "preempted by urgent (1a2b3c4d): its deadline 06:00:00 UTC would be missed otherwise"
    snap = SimpleNamespace(running=[], behind={}, lost=[], blocked={}, requeue=[], preempted=["v1"],
                           runs={"v1": victim}, specs={"v1": JobSpec.model_validate(SPEC)}, now=1000.0)
    assert job_rows(snap, []) == [
        ("JOB", "RUN", "STATE", "NODE", "GPUS", "START", "REASON"),
        ("train", "v1", "Preempted", "-", "-", "-", "preempted by urgent (1a2b3c4d): its deadline 06:00:00 UTC would "
         "be missed otherwise; queued again at the scheduler's next tick, resumes from there")]


def test_a_preemption_one_of_whose_victims_changed_since_the_plan_stops_none_of_them():
    from e31.flows.placement.model import Placement
    from e31.flows.placement.preemption import PlannedPreemption, Preemption

    class _OneChanged(_Writes):
        def current(self, key):
            return key != "v2"  # v2 ended between the plan and the write

    victims = {k: _run(key=k) for k in ("v1", "v2")}
    urgent = _run("SCHEDULED", "Scheduled", key="u1")
    snap = SimpleNamespace(now=1060.0, behind={}, running=[], runs={**victims, "u1": urgent}, queued=[SimpleNamespace(
                               id="u1", deadline=None, work_deadline=None, attained_s=0.0, gpus=2)],
                           specs={k: JobSpec.model_validate(SPEC) for k in ("v1", "v2", "u1")})
    planned = [PlannedPreemption("u1", Preemption("n1", ("v1", "v2"), (0, 1), 10.0))]
    placements = [Placement("u1", "start", "n1", (0, 1), 2, 1060.0, 1160.0, "")]
    write, counts = _OneChanged([]), {}
    assert preempt.start(write, snap, planned, placements, _logs(), counts) == set()
    assert write.written == [] and counts == {}

    class _AllCurrent(_Writes):
        def current(self, key):
            return True

    write = _AllCurrent([])
    assert preempt.start(write, snap, planned, placements, _logs(), counts) == {"u1"}
    assert [(w[0], w[1]) for w in write.written] == [("v1", "CANCELLING"), ("v2", "CANCELLING"), ("u1", "placement"),
                                                      ("u1", "SCHEDULED")]


def test_a_requeued_run_s_reasons_keep_the_preemption_it_waits_after():
    """The scheduler's next reason replaced 'preempted by ...' within a second: e31 queue never said why the
    run was back in the queue.  The clause is found in the requeue's message and in a later reason that kept
    it (once, not nested)."""
    clause = "preempted by nc1 (86ad0153): tenant nlp takes back, within its quota, what tenant vision borrowed; at 12:33:09 UTC"
    requeued = f"Queued: {clause}; returned step 8; queued again, resumes from there"
    assert preempt.preempted_clause(requeued) == clause
    later = f"Queued: waiting for 2 GPUs on one node (0 free on n-1); earlier: {clause}"
    assert preempt.preempted_clause(later) == clause
    assert preempt.preempted_clause("Queued: waiting for 2 GPUs") == ""
    assert preempt.preempted_clause(None) == ""
