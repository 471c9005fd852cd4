"""Properties of every plan (hypothesis): no oversubscription, nothing before now, feasible
deadlines kept on a free pool, the same input gives the same plan."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e31.flows.placement import POLICIES, Node, QueuedJob, RunningJob, plan
from tests.flows.placement.helpers import GIB, H, T0

FEW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def pools(draw) -> list[Node]:
    count = draw(st.integers(1, 4))
    return [Node(f"n{i}", draw(st.sampled_from([0, 1, 2, 4, 8])), draw(st.integers(1, 16)),
                 draw(st.integers(1, 8)) * GIB, draw(st.sampled_from([None, "A", "B"])))
            for i in range(count)]


@st.composite
def busy(draw, nodes: list[Node]) -> list[RunningJob]:
    """Running jobs that fit their nodes (disjoint devices, CPUs and memory within capacity)."""
    jobs = []
    for node in nodes:
        gpus, cpus, memory = list(range(node.gpus)), node.cpus, node.memory
        for k in range(draw(st.integers(0, 3))):
            g = draw(st.integers(0, len(gpus)))
            c, m = draw(st.integers(0, cpus)), draw(st.integers(0, memory // GIB)) * GIB
            devices, gpus = tuple(gpus[:g]), gpus[g:]
            cpus, memory = cpus - c, memory - m
            end = T0 + draw(st.integers(-2, 20)) * 900
            jobs.append(RunningJob(f"{node.name}-r{k}", node.name, devices, c, m, T0 - H, end))
    return jobs


@st.composite
def queues(draw, deadlines: bool = True) -> list[QueuedJob]:
    jobs = []
    for k in range(draw(st.integers(0, 12))):
        runtime = draw(st.integers(1, 16)) * 900.0
        submitted = T0 - draw(st.integers(0, 40)) * 900
        deadline = None
        if deadlines and draw(st.booleans()):
            deadline = submitted + draw(st.integers(-2, 40)) * 900
        jobs.append(QueuedJob(
            id=f"q{k}", name=f"job{k % 3}", gpus=draw(st.sampled_from([0, 1, 2, 3, 8, 9])), cpus=draw(st.integers(1, 12)),
            memory=draw(st.integers(0, 6)) * GIB, submitted=submitted, runtime_s=runtime, limit_s=runtime * 2,
            gpu_type=draw(st.sampled_from([None, None, "A", "b"])), deadline=deadline,
            staging_s=draw(st.sampled_from([0.0, 60.0, 600.0])),
        ))
    return jobs


def check_never_oversubscribed(nodes, running, queued, placements):
    memory = {j.id: j.memory for j in [*running, *queued]}
    spans = {n.name: [] for n in nodes}
    for r in running:
        spans[r.node].append((T0, max(r.expected_end, T0 + 1), set(r.devices), r.cpus, memory[r.id]))
    for p in placements:
        if p.action != "refuse":
            spans[p.node].append((p.start, p.end, set(p.devices), p.cpus, memory[p.job]))
    for node in nodes:
        for t in sorted({s[0] for s in spans[node.name]}):
            live = [s for s in spans[node.name] if s[0] <= t < s[1]]
            devices = [d for s in live for d in s[2]]
            assert len(devices) == len(set(devices)), (node.name, t, live)
            assert all(0 <= d < node.gpus for d in devices)
            assert sum(s[3] for s in live) <= node.cpus
            assert sum(s[4] for s in live) <= node.memory


@FEW
@given(data=st.data(), policy=st.sampled_from(POLICIES))
def test_no_plan_oversubscribes_or_starts_early(data, policy):
    nodes = data.draw(pools())
    running, queued = data.draw(busy(nodes)), data.draw(queues())
    placements = plan(nodes, running, queued, T0, policy, depth=data.draw(st.sampled_from([1, 2, 64])))
    assert sorted(p.job for p in placements) == sorted(j.id for j in queued)
    check_never_oversubscribed(nodes, running, queued, placements)
    by_id = {j.id: j for j in queued}
    for p in placements:
        if p.action == "refuse":
            assert p.node is None and p.reason
            continue
        job = by_id[p.job]
        assert p.start >= T0 >= job.submitted
        assert p.end == p.start + job.occupancy_s
        assert len(p.devices) == job.gpus and p.cpus == job.cpus
        assert (p.action == "start") == (p.start == T0)
        node = next(n for n in nodes if n.name == p.node)
        assert job.gpu_type is None or (node.gpu_type or "").lower() == job.gpu_type.lower()


@FEW
@given(data=st.data())
def test_a_feasible_deadline_is_kept_on_a_free_pool(data):
    nodes = data.draw(pools())
    others = data.draw(queues(deadlines=False))
    big = max(nodes, key=lambda n: (n.gpus, n.cpus, n.memory))
    runtime = data.draw(st.integers(1, 16)) * 900.0
    slack = data.draw(st.integers(0, 40)) * 900.0
    job = QueuedJob(id="due", name="due", gpus=data.draw(st.integers(0, big.gpus)),
                    cpus=data.draw(st.integers(1, big.cpus)), memory=data.draw(st.integers(0, big.memory // GIB)) * GIB,
                    submitted=T0 - data.draw(st.integers(0, 8)) * 900, runtime_s=runtime, limit_s=runtime * 2,
                    staging_s=60.0, deadline=T0 + 60 + runtime + slack)
    (due,) = [p for p in plan(nodes, [], [*others, job], T0) if p.job == "due"]
    assert due.action in ("start", "wait") and due.end <= job.deadline, due


@FEW
@given(data=st.data(), policy=st.sampled_from(POLICIES))
def test_the_same_input_gives_the_same_plan(data, policy):
    nodes = data.draw(pools())
    running, queued = data.draw(busy(nodes)), data.draw(queues())
    first = plan(nodes, running, queued, T0, policy)
    assert plan(nodes, running, queued, T0, policy) == first
    shuffle = random.Random(data.draw(st.integers(0, 1000)))
    queued, running = queued[:], running[:]
    shuffle.shuffle(queued)
    shuffle.shuffle(running)
    again = plan(nodes, running, queued, T0, policy)
    assert [p for p in again if p.action != "refuse"] == [p for p in first if p.action != "refuse"]
    assert sorted(p.job for p in again if p.action == "refuse") == sorted(p.job for p in first if p.action == "refuse")
