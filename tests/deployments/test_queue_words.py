"""The queue never reads its own words: with every reason the planner and
the scheduler write replaced by ``x`` (the builders patched, and the
server keeping ``x`` for every state message), the placements, what a
node's prefetcher takes, which worker a placement wakes and the planned
node the next plan keeps between equally free nodes are the same.

The scheduler's functions run against an in-memory stand-in for the Prefect
server's flow runs (what ``apply`` and ``planned_here`` call); the real
server's side of each write is covered by tests/deployments/test_run_cache.py
and test_queue.py."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from types import SimpleNamespace

from prefect.events.schemas.events import Event
from prefect.states import Scheduled

from e31.deployments.prefetch_runs import planned_here
from e31.deployments.runevents import event_tags
from e31.flows.placement import Node, QueuedJob, RunningJob, plan
from e31.flows.placement import planner as planner_module
from e31.flows.placement import reasons as reasons_module
from e31.flows.queue import PLACED, QUEUED, RunCache, apply, placed_on, record_of
from e31.flows.queue import record as record_module
from e31.flows.queue.snapshot import Snapshot, _planned

NOW = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC
Q1, Q2, Q3 = (str(uuid.UUID(int=i)) for i in (1, 2, 3))  # flow run ids


class _Server:
    """The flow runs of one work pool as the Prefect API keeps them: each state
    written gets a new id and is kept in the run's history; ``words`` replaces
    every state message written (None: kept as sent)."""

    def __init__(self, words: str | None) -> None:
        self.words, self.runs, self.history, self.logs = words, {}, {}, []

    def submit(self, key: str) -> None:
        state = Scheduled(name=QUEUED, message="Queued: submitted",
                          scheduled_time=datetime.fromtimestamp(NOW, timezone.utc)).model_copy(
            update={"id": uuid.uuid4(), "timestamp": datetime.fromtimestamp(NOW - 100, timezone.utc)})
        self.runs[key] = SimpleNamespace(id=key, state=state, parameters={"spec": {"name": key}}, tags=["e31"],
                                         next_scheduled_start_time=state.state_details.scheduled_time, job_variables={})
        self.history[key] = [state]

    def read_flow_run(self, key):
        return self.runs[str(key)]

    def set_flow_run_state(self, key, state, force=False):
        run = self.runs[str(key)]
        kept = state.model_copy(update={"id": uuid.uuid4(), "timestamp": datetime.fromtimestamp(NOW, timezone.utc),
                                        "message": state.message if self.words is None else self.words})
        run.state = kept
        if kept.state_details.scheduled_time is not None:
            run.next_scheduled_start_time = kept.state_details.scheduled_time
        self.history[str(key)].append(kept)
        return SimpleNamespace(state=kept)

    def read_flow_run_states(self, key):
        return list(self.history[str(key)])

    def update_flow_run(self, key, parameters=None, tags=None):
        run = self.runs[str(key)]
        if parameters is not None:
            run.parameters = dict(parameters)
        if tags is not None:
            run.tags = list(tags)

    def create_logs(self, lines):
        self.logs.extend(lines)

    def read_flow_runs(self, **filters):  # planned_here's read: the pool's Queued runs, soonest scheduled first
        queued = [r for r in self.runs.values() if r.state.type.value == "SCHEDULED" and r.state.name == QUEUED]
        return sorted(queued, key=lambda r: r.next_scheduled_start_time)


def _placed_event(run) -> Event:
    """The ``Placed`` event the server sends for ``run`` (its tags as related resources)."""
    return Event(event=f"prefect.flow-run.{PLACED}",
                 resource={"prefect.resource.id": f"prefect.flow-run.{run.id}", "prefect.state-message": run.state.message},
                 related=[{"prefect.resource.id": f"prefect.tag.{t}", "prefect.resource.role": "tag"} for t in run.tags])


def _queue_life(words: str | None, monkeypatch) -> list:
    """Three ticks of a two-node pool whose nodes both prefetch, and what the
    queue did at each: the placements (job, action, node, devices, start),
    each run's placement record and tags, the runs each node's prefetcher
    takes, and for each ``Placed`` run which node's worker its event wakes."""
    if words is not None:  # every reason builder says ``words``
        monkeypatch.setattr(planner_module, "start_reason", lambda *args: words)
        monkeypatch.setattr(reasons_module.Explainer, "_wait",
                            lambda self, job, eligible, node, start, reserved, clock:
                            (words, self.cap.ender(node, start) if reserved else None))
        monkeypatch.setattr(record_module, "humane", lambda reason, snap: words)
    server = _Server(words)
    jobs = {key: QueuedJob(id=key, name=key, gpus=0, cpus=2, memory=0, submitted=NOW - 100 + i, runtime_s=600.0,
                           limit_s=1200.0) for i, key in enumerate((Q1, Q2, Q3))}
    for key in jobs:
        server.submit(key)
    pool = SimpleNamespace(name="words", nodes=[])
    cache = RunCache(pool)
    cache.runs = server.runs
    specs = {key: SimpleNamespace(name=key, request=SimpleNamespace(memory=0, retries=0)) for key in jobs}
    n1, n2 = Node("n1", 0, 2, 2**30), Node("n2", 0, 2, 2**30)
    ticks = [
        ([n1, n2], [RunningJob("r1", "n1", (), 2, 0, NOW - 60, NOW + 600),
                    RunningJob("r2", "n2", (), 2, 0, NOW - 60, NOW + 600)]),  # equally free: q1 on n1, pool order
        ([n2, n1], [RunningJob("r1", "n1", (), 2, 0, NOW - 60, NOW + 600),  # n2 first now: q1 keeps its n1
                    RunningJob("r2", "n2", (), 2, 0, NOW - 60, NOW + 600)]),
        ([n2, n1], [RunningJob("r2", "n2", (), 2, 0, NOW - 60, NOW + 600)]),  # r1 ended: q1 starts on n1
    ]
    seen = []
    for nodes, running in ticks:
        waiting = [k for k, r in server.runs.items() if r.state.name == QUEUED]
        queued = [QueuedJob(**{**jobs[k].__dict__, "planned_node": _planned(server.runs[k])}) for k in waiting]
        snap = Snapshot(now=NOW, nodes=nodes, runs=server.runs, specs=specs, running=running, queued=queued,
                        prefetching=frozenset({"n1", "n2"}), pool="words")
        placements = plan(nodes, running, queued, NOW)
        apply(server, snap, placements, cache)
        seen.append((
            [(p.job, p.action, p.node, p.devices, p.start) for p in placements],
            {k: (record_of(r), sorted(r.tags), r.state.name) for k, r in server.runs.items()},
            {n: [str(r.id) for r in planned_here(server, pool, n)] for n in ("n1", "n2")},
            {k: [n for n in ("n1", "n2") if placed_on(event_tags(_placed_event(r))) in (None, n)]
             for k, r in server.runs.items() if r.state.name == PLACED},
        ))
    return seen


def test_rewording_every_reason_changes_nothing_the_queue_does(monkeypatch):
    worded = _queue_life(None, monkeypatch)
    with monkeypatch.context() as patched:
        rewritten = _queue_life("x", patched)
    assert rewritten == worded
    first, second, third = worded
    assert first[0][:2] == [(Q1, "wait", "n1", (), NOW + 600), (Q2, "wait", "n2", (), NOW + 600)]
    assert first[2] == {"n1": [Q1, Q3], "n2": [Q2]}  # each node's prefetcher takes the run planned on it
    assert second[0][:2] == [(Q1, "wait", "n1", (), NOW + 600), (Q2, "wait", "n2", (), NOW + 600)]  # kept
    # without the planned node it kept, the tie would have gone to n2 (first in the pool now)
    fresh = QueuedJob(id=Q1, name="q1", gpus=0, cpus=2, memory=0, submitted=NOW - 100, runtime_s=600.0, limit_s=1200.0)
    busy = [RunningJob("r1", "n1", (), 2, 0, NOW - 60, NOW + 600), RunningJob("r2", "n2", (), 2, 0, NOW - 60, NOW + 600)]
    assert plan([Node("n2", 0, 2, 2**30), Node("n1", 0, 2, 2**30)], busy, [fresh], NOW)[0].node == "n2"
    assert third[0][0] == (Q1, "start", "n1", (), NOW)
    assert third[1][Q1] == (record_of(SimpleNamespace(parameters={"placement": {
        "e31_node": "n1", "gpu_devices": [], "cpus": 2, "e31_attempt": 0}})), ["e31", "e31-placed:n1"], PLACED)
    assert third[3] == {Q1: ["n1"]}  # its Placed event wakes n1's worker alone
    assert third[2] == {"n1": [Q3], "n2": [Q2]}  # q1 is no longer waiting; q3 keeps n1


def test_a_tick_that_queues_a_run_again_starts_nothing_the_next_tick_plans_with_it():
    """A crashed run queued again is not in this tick's plan: a start the plan made without it could take
    what it has priority to (a crashed deadline job would then preempt its victim a second time).  The
    start waits one tick (counted deferred); the requeue is written."""
    from prefect.states import Crashed

    server = _Server(None)
    for key in (Q1, Q2):
        server.submit(key)
    crash = Crashed(message="its flow process is gone").model_copy(
        update={"id": uuid.uuid4(), "timestamp": datetime.fromtimestamp(NOW - 30, timezone.utc)})
    server.runs[Q1].state, server.runs[Q1].run_count = crash, 1
    server.runs[Q1].parameters = {"spec": {"name": Q1}, "placement": {"e31_node": "n1", "e31_attempt": 0}}
    server.runs[Q1].tags = ["e31", "e31-work-started:1:1799999900"]
    server.runs[Q2].run_count = 0
    specs = {key: SimpleNamespace(name=key, request=SimpleNamespace(memory=0, retries=1)) for key in (Q1, Q2)}
    n1 = Node("n1", 0, 2, 2**30)
    queued = [QueuedJob(id=Q2, name=Q2, gpus=0, cpus=2, memory=0, submitted=NOW - 100, runtime_s=600.0, limit_s=1200.0)]
    snap = Snapshot(now=NOW, nodes=[n1], runs=server.runs, specs=specs, running=[], queued=queued, pool="words")
    snap.requeue.append(Q1)
    placements = plan([n1], [], queued, NOW)
    assert [(p.job, p.action) for p in placements] == [(Q2, "start")]
    counts = apply(server, snap, placements)
    assert (counts["requeued"], counts["start"], counts["deferred"]) == (1, 0, 1)
    assert (server.runs[Q1].state.name, server.runs[Q2].state.name) == (QUEUED, QUEUED)


def test_a_run_lost_with_its_node_while_it_was_preempted_is_queued_again_using_none_of_its_retries():
    """Its crash (the scheduler's, for the lost node) says it was being preempted: that attempt counts
    as a preemption, so a job with no retries left is still queued again, and its record keeps it."""
    from prefect.states import Crashed

    from e31.flows.queue.preempt import PREEMPTED_LOST
    from e31.flows.queue.snapshot import retries_used

    server = _Server(None)
    server.submit(Q1)
    crash = Crashed(message=f"{PREEMPTED_LOST}node n1 stopped answering").model_copy(
        update={"id": uuid.uuid4(), "timestamp": datetime.fromtimestamp(NOW - 30, timezone.utc)})
    run = server.runs[Q1]
    run.state, run.run_count = crash, 1
    run.parameters = {"spec": {"name": Q1}, "placement": {"e31_node": "n1", "e31_attempt": 0}}
    run.tags = ["e31", "e31-work-started:1:1799999900"]
    assert retries_used(run) == 0
    specs = {Q1: SimpleNamespace(name=Q1, request=SimpleNamespace(memory=0, retries=0))}
    snap = Snapshot(now=NOW, nodes=[Node("n1", 0, 2, 2**30)], runs=server.runs, specs=specs, running=[], queued=[],
                    pool="words")
    snap.requeue.append(Q1)
    assert apply(server, snap, [])["requeued"] == 1
    assert run.state.name == QUEUED and run.state.message.startswith(
        "Queued: preempted, then lost with its node before its output came back; none of its retries used")
    assert record_of(run).preempted == (NOW - 30,)
    assert retries_used(SimpleNamespace(run_count=1, state=run.state, parameters=run.parameters,
                                        job_variables=None, tags=run.tags)) == 0
