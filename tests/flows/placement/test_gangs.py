"""Multi-node jobs (gangs) in the pure planner: all nodes at once or none, a reservation on every
node that backfilled jobs never touch, one group preferred, refusals, running gangs, replays."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e31.flows.placement import POLICIES, Node, QueuedJob, RunningJob, plan
from e31.flows.placement.capacity import Capacity
from e31.flows.placement.gangs import earliest_gang
from e31.flows.placement.preemption import PreemptionRules, may_preempt
from e31.flows.placement.simulate import SimJob, simulate
from tests.flows.placement.helpers import GIB, H, T0, node, queued, running

FEW = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def gang(job_id: str, nodes: int, gpus: int, hours: float, **kw) -> QueuedJob:
    return replace(queued(job_id, gpus, hours, **kw), nodes=nodes)


def by_job(placements):
    return {p.job: p for p in placements}


def test_a_gang_on_a_free_pool_starts_now_on_as_many_nodes_with_whole_devices_on_each():
    nodes = [node("a"), node("b"), node("c")]
    p = by_job(plan(nodes, [], [gang("g", 2, 8, 1.0)], T0))["g"]
    assert p.action == "start" and p.start == T0
    assert (p.node, p.devices) == ("a", tuple(range(8)))
    assert p.gang == (("b", tuple(range(8))),)
    assert p.reason == ("starts now on 2 nodes: a (GPUs 0-7), b (GPUs 0-7), 4 CPUs each; expected end 01:00 UTC "
                        "(run time 1h: duration)")


def test_a_gang_waits_until_all_its_nodes_are_free_together_and_backfill_never_delays_it():
    nodes = [node("a"), node("b")]
    busy = [running("r", "b", range(8), until_h=1.5)]
    queue = [gang("g", 2, 8, 1.0, ago_h=1.0),
             queued("short", 8, 1.0, ago_h=0.5),   # ends before the gang's start on a: backfills
             queued("long", 8, 3.0, ago_h=0.4)]    # would overlap it: waits behind it
    placements = by_job(plan(nodes, busy, queue, T0, "easy"))
    g = placements["g"]
    assert g.action == "wait" and g.start == T0 + 1.5 * H and g.reserved
    assert {g.node, *(name for name, _ in g.gang)} == {"a", "b"}
    assert g.reason == ("waiting for 2 nodes with 8 GPUs free at once (a gang starts on all its nodes together; "
                        "1 has it free now); earliest start 01:30 UTC on a, b")
    # the short job's limit is 2 h: it fits before the gang's start only on its estimate, so EASY's
    # guarantee (a backfilled job may run to its limit) keeps it off a as well
    assert placements["short"].action == "wait" and placements["short"].start >= g.start + H
    assert placements["long"].action == "wait" and placements["long"].start >= g.start + H


def test_a_job_that_fits_before_the_gang_on_its_limit_backfills():
    nodes = [node("a"), node("b")]
    busy = [running("r", "b", range(8), until_h=2.0)]
    short = replace(queued("short", 8, 1.0, ago_h=0.5), limit_s=1.5 * H)
    placements = by_job(plan(nodes, busy, [gang("g", 2, 8, 1.0, ago_h=1.0), short], T0, "easy"))
    assert placements["short"].action == "start" and placements["short"].node == "a"
    assert placements["g"].start == T0 + 2 * H


def test_a_gang_prefers_the_nodes_of_one_group():
    nodes = [Node("r1-a", 8, 64, 512 * GIB, group="r1"), Node("r2-a", 8, 64, 512 * GIB, group="r2"),
             Node("r1-b", 8, 64, 512 * GIB, group="r1"), Node("r2-b", 8, 64, 512 * GIB, group="r2")]
    p = by_job(plan(nodes, [], [gang("g", 2, 8, 1.0)], T0))["g"]
    assert (p.node, p.gang[0][0]) == ("r1-a", "r1-b")
    busy = [running("r", "r1-b", [0], until_h=5.0)]
    p = by_job(plan(nodes, busy, [gang("g", 2, 8, 1.0)], T0))["g"]
    assert p.action == "start" and (p.node, p.gang[0][0]) == ("r2-a", "r2-b")
    # no group has two free nodes: any two nodes, rather than a wait
    busy = [running("r", "r1-b", [0], until_h=5.0), running("s", "r2-b", [0], until_h=5.0)]
    p = by_job(plan(nodes, busy, [gang("g", 2, 8, 1.0)], T0))["g"]
    assert p.action == "start" and (p.node, p.gang[0][0]) == ("r1-a", "r2-a")


def test_a_gang_larger_than_the_pool_is_refused_with_the_fix():
    nodes = [node("a"), node("b"), node("small", gpus=2)]
    p = by_job(plan(nodes, [], [gang("g", 3, 8, 1.0)], T0))["g"]
    assert p.action == "refuse"
    assert p.reason == ("asks for 3 nodes of 8 GPUs, 4 CPUs each, and only 2 nodes of the pool can hold that: ask "
                        "for at most 2 nodes, or add nodes to the pool file")


def test_a_one_node_request_wider_than_every_node_is_told_the_gang_it_splits_into():
    """request.gpus: 16 on nodes of 8 GPUs: the fix names request.nodes: 2 with 8 GPUs per node (its CPUs
    and memory divided too); 9 GPUs split evenly only over 3 nodes, more than this pool has; a split
    needs that many nodes of the GPU type asked for."""
    nodes = [node("a"), node("b"), node("small", gpus=2)]
    wide = queued("wide", 16, 1, cpus=32, memory_gib=100)
    odd, typed = queued("odd", 9, 1), queued("typed", 16, 1, gpu_type="A100")
    nodes_a100 = [node("a", gpu_type="A100"), node("b", gpu_type="H100")]
    assert by_job(plan(nodes, [], [wide, odd], T0))["wide"].reason == (
        "no node can hold 16 GPUs: the largest nodes have 8 GPUs: ask for at most 8 GPUs (request.gpus), spread it "
        "over 2 nodes (request.nodes: 2 with request.gpus: 8, request.cpus: 16, request.memory: 50 GiB per node), or "
        "add a larger node to the pool file")
    three = [node("a"), node("b"), node("c")]
    assert by_job(plan(three, [], [queued("odd", 9, 1, memory_gib=1)], T0))["odd"].reason == (
        "no node can hold 9 GPUs: the largest nodes have 8 GPUs: ask for at most 8 GPUs (request.gpus), spread it "
        "over 3 nodes (request.nodes: 3 with request.gpus: 3, request.cpus: 2, request.memory: 342 MiB per node), or "
        "add a larger node to the pool file")  # 3 x 342 MiB >= 1 GiB: the shares never ask for less
    assert by_job(plan(nodes, [], [odd], T0))["odd"].reason == (
        "no node can hold 9 GPUs: the largest nodes have 8 GPUs: ask for at most 8 GPUs (request.gpus), or add a "
        "larger node to the pool file")
    assert by_job(plan(nodes_a100, [], [typed], T0))["typed"].reason == (
        "no node can hold 16 GPUs: the largest A100 nodes have 8 GPUs: ask for at most 8 GPUs (request.gpus), or add "
        "a larger node to the pool file")


def test_a_running_gang_holds_every_one_of_its_nodes_and_is_never_a_victim():
    nodes = [node("a"), node("b")]
    held = RunningJob("g", "a", tuple(range(8)), 4, 0, T0 - H, T0 + H, preemptible=True,
                      gang=(("b", tuple(range(8))),))
    p = by_job(plan(nodes, [held], [queued("one", 1, 1.0)], T0))["one"]
    assert p.action == "wait" and p.start == T0 + H
    assert held.gpus_held == 16
    assert not may_preempt(held, T0 + 10 * H, PreemptionRules(min_run_s=0.0))
    assert may_preempt(replace(held, gang=()), T0 + 10 * H, PreemptionRules(min_run_s=0.0))


def test_capacity_finds_the_first_time_enough_nodes_are_free_at_once():
    nodes = [node("a"), node("b"), node("c")]
    busy = [running("ra", "a", range(8), until_h=1.0), running("rb", "b", range(8), until_h=3.0),
            running("rc", "c", range(4), until_h=2.0)]
    cap = Capacity(nodes, busy, T0)
    start, parts = earliest_gang(cap, (8, 4, 0, H), 2, None, T0)
    assert start == T0 + 2 * H and sorted(i for i, _ in parts) == [0, 2]
    start, parts = earliest_gang(cap, (4, 4, 0, H), 2, None, T0)
    assert start == T0 + 1 * H and sorted(i for i, _ in parts) == [0, 2]
    assert earliest_gang(cap, (8, 4, 0, H), 4, None, T0) is None
    assert earliest_gang(cap, (8, 4, 0, H), 2, None, T0, T0 + H) is None


@st.composite
def gang_pools(draw):
    count = draw(st.integers(2, 5))
    nodes = [Node(f"n{i}", draw(st.sampled_from([2, 4, 8])), draw(st.integers(4, 16)), 8 * GIB,
                  group=draw(st.sampled_from([None, "x", "y"]))) for i in range(count)]
    busy = []
    for n in nodes:
        if draw(st.booleans()):
            g = draw(st.integers(0, n.gpus))
            busy.append(RunningJob(f"{n.name}-r", n.name, tuple(range(g)), draw(st.integers(0, n.cpus)), 0, T0 - H,
                                   T0 + draw(st.integers(-1, 12)) * 900))
    queue = []
    for k in range(draw(st.integers(1, 10))):
        runtime = draw(st.integers(1, 12)) * 900.0
        queue.append(QueuedJob(
            id=f"q{k}", name=f"q{k}", gpus=draw(st.sampled_from([0, 1, 2, 4, 8])), cpus=draw(st.integers(1, 8)),
            memory=0, submitted=T0 - draw(st.integers(0, 20)) * 900, runtime_s=runtime,
            limit_s=runtime * draw(st.sampled_from([1, 2])), nodes=draw(st.sampled_from([1, 1, 2, 3]))))
    return nodes, busy, queue


def _spans(nodes, busy, queue, placements):
    by_id = {j.id: j for j in queue}
    spans = {n.name: [] for n in nodes}
    for r in busy:
        spans[r.node].append((T0, max(r.expected_end, T0 + 1), set(r.devices), r.cpus))
    for p in placements:
        if p.action == "refuse":
            continue
        job = by_id[p.job]
        for name, devices in ((p.node, p.devices), *p.gang):
            spans[name].append((p.start, p.end, set(devices), job.cpus))
    return spans


@FEW
@given(data=st.data(), policy=st.sampled_from(POLICIES))
def test_no_plan_with_gangs_oversubscribes_and_every_gang_gets_distinct_whole_nodes(data, policy):
    nodes, busy, queue = data.draw(gang_pools())
    placements = plan(nodes, busy, queue, T0, policy, depth=data.draw(st.sampled_from([1, 64])))
    by_id = {j.id: j for j in queue}
    sizes = {n.name: n for n in nodes}
    for p in placements:
        job = by_id[p.job]
        if p.action == "refuse":
            assert sum(sizes[n].gpus >= job.gpus and sizes[n].cpus >= job.cpus for n in sizes) < job.nodes
            continue
        names = [p.node, *(name for name, _ in p.gang)]
        assert len(names) == len(set(names)) == job.nodes
        assert all(len(devices) == job.gpus for devices in [p.devices, *(d for _, d in p.gang)])
        assert (p.action == "start") == (p.start == T0)
    for name, spans in _spans(nodes, busy, queue, placements).items():
        for t in sorted({s[0] for s in spans}):
            live = [s for s in spans if s[0] <= t < s[1]]
            devices = [d for s in live for d in s[2]]
            assert len(devices) == len(set(devices)), (name, t, live)
            assert all(0 <= d < sizes[name].gpus for d in devices)
            assert sum(s[3] for s in live) <= sizes[name].cpus


@FEW
@given(data=st.data())
def test_jobs_submitted_after_a_gang_at_the_head_never_move_its_reserved_start_under_easy(data):
    nodes, busy, queue = data.draw(gang_pools())
    head = replace(queue[0], nodes=2, submitted=T0 - 100 * H)
    if sum(n.gpus >= head.gpus and n.cpus >= head.cpus for n in nodes) < 2:
        return
    alone = by_job(plan(nodes, busy, [head], T0, "easy"))[head.id]
    later = [replace(j, submitted=T0) for j in queue[1:]]
    together = by_job(plan(nodes, busy, [head, *later], T0, "easy"))[head.id]
    assert together.start == alone.start


def test_a_replay_runs_every_gang_with_all_its_nodes_at_once_and_counts_their_gpus():
    nodes = [node("a"), node("b"), node("c")]
    jobs = [SimJob(gang("g1", 2, 8, 1.0), actual_s=H), SimJob(queued("s1", 8, 2.0), actual_s=2 * H),
            SimJob(gang("g2", 3, 8, 1.0), actual_s=H), SimJob(queued("s2", 4, 0.5), actual_s=0.5 * H)]
    result = simulate(nodes, jobs, "easy")
    assert result.refused == 0 and result.jobs == 4
    # g1 on a and b; g2 reserves all three nodes from g1's end; s1 (limit 4 h) cannot run before that
    # on c, s2 (limit 1 h) can
    assert result.starts == {"g1": T0, "s2": T0, "g2": T0 + H, "s1": T0 + 2 * H}
    assert result.ends["g2"] == T0 + 2 * H and result.ends["s1"] == T0 + 4 * H
    # busy GPU-hours: g1 16, s2 2, g2 24, s1 16, over 3 nodes x 8 GPUs x 4 h
    assert abs(result.utilization - (16 + 2 + 24 + 16) / 96) < 1e-9
