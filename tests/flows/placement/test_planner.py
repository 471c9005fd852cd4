"""Hand-built queues with exact plans and reasons (times from 2026-01-01 00:00 UTC)."""

from __future__ import annotations

import pytest

from e31.flows.placement import PlanInputError, plan
from tests.flows.placement.helpers import GIB, H, T0, node, queued, running


def table(placements):
    """job -> (action, node, devices, start hour, end hour, reason)."""
    return {p.job: (p.action, p.node, p.devices, None if p.start is None else (p.start - T0) / H,
                    None if p.end is None else (p.end - T0) / H, p.reason) for p in placements}


# n1 has 8 GPUs; r1 holds GPUs 0-5 until 02:00; A (8 GPUs, 1 h) came first and waits for r1.
POOL = [node("n1")]
R1 = [running("r1", "n1", range(6), 2)]
A_WAITS = ("wait", "n1", tuple(range(8)), 2.0, 3.0,
           "waiting for 8 GPUs on one node (0 free on n1); earliest start 02:00 UTC on n1, after job r1 ends")


@pytest.mark.parametrize("policy", ["easy", "e31"])
def test_a_backfill_that_must_happen(policy):
    # B (2 GPUs, 1 h) fits GPUs 6,7 now and ends at 01:00, before A's reserved start at 02:00
    plan_ = table(plan(POOL, R1, [queued("A", 8, 1, ago_h=1 / 6), queued("B", 2, 1, ago_h=1 / 12)], T0, policy))
    assert plan_ == {
        "A": A_WAITS,
        "B": ("start", "n1", (6, 7), 0.0, 1.0,
              "starts now on n1, GPUs 6,7, 4 CPUs; expected end 01:00 UTC (run time 1h: duration)"),
    }


@pytest.mark.parametrize(("policy", "b_reason"), [
    ("easy", "waiting: room is free now on n1 but held for jobs ahead of it from 02:00 UTC; estimated start "
             "03:00 UTC (not reserved: only the first waiting job in priority order holds a reservation)"),
    ("e31", "waiting: room is free now on n1 but held for jobs ahead of it from 02:00 UTC; earliest start "
            "03:00 UTC on n1, after job A ends"),
])
def test_a_backfill_that_must_not_happen(policy, b_reason):
    # B (2 GPUs, 3 h) would still hold GPUs 6,7 at 02:00, when A needs all eight: it would delay A
    placements = plan(POOL, R1, [queued("A", 8, 1, ago_h=1 / 6), queued("B", 2, 3, ago_h=1 / 12)], T0, policy)
    assert table(placements) == {
        "A": A_WAITS[:5] + ("waiting for 8 GPUs on one node (2 free on n1); earliest start 02:00 UTC on n1, "
                            "after job r1 ends",),
        "B": ("wait", "n1", (0, 1), 3.0, 6.0, b_reason),
    }
    assert [p.reserved for p in placements] == [True, policy == "e31"]


def test_first_come_first_served_never_overtakes():
    placements = plan(POOL, R1, [queued("A", 8, 1, ago_h=1 / 6), queued("B", 2, 1, ago_h=1 / 12)], T0, "fcfs")
    assert table(placements)["B"] == ("wait", "n1", (0, 1), 3.0, 4.0, "waiting for its turn (first come, first "
                                      "served); earliest start 03:00 UTC on n1, after job A ends")


@pytest.mark.parametrize(("policy", "starts"), [
    ("fcfs", {"A": 1.0, "D": 3.0}),  # first come, first served: D ends 04:00, after its deadline
    ("easy", {"A": 1.0, "D": 3.0}),
    ("edf", {"D": 1.0, "A": 2.0}),
    ("e31", {"D": 1.0, "A": 2.0}),  # D needs the time: it goes ahead of A, which has no deadline
])
def test_a_deadline_job_jumps_ahead_of_an_earlier_job_with_slack(policy, starts):
    # the whole node is busy until 01:00; A (2 h) came 30 min before D (1 h, deadline 02:30)
    placements = plan([node("n1")], [running("r1", "n1", range(8), 1)],
                      [queued("A", 8, 2, ago_h=0.5), queued("D", 8, 1, deadline_h=2.5)], T0, policy)
    assert {p.job: (p.start - T0) / H for p in placements} == starts
    d = table(placements)["D"]
    if policy in ("edf", "e31"):
        assert d[5] == ("waiting for 8 GPUs on one node (0 free on n1); earliest start 01:00 UTC on n1, "
                        "after job r1 ends; "
                        "ends 02:00 UTC, before its deadline 02:30 UTC")
    else:
        assert d[5].endswith("; ends 04:00 UTC, after its deadline 02:30 UTC: at risk")


def test_the_reason_names_what_is_short_and_who_frees_it():
    nodes = [node("n1"), node("n2"), node("n3")]
    busy = [running("a", "n1", range(8), 5), running("b", "n2", range(8), 5),
            running("retrain-7", "n3", range(6), 2 + 40 / 60)]
    (only,) = plan(nodes, busy, [queued("X", 6, 1)], T0)
    assert only.reason == ("waiting for 6 GPUs on one node (2 free on n3); earliest start 02:40 UTC on n3, "
                           "after job retrain-7 ends")
    assert (only.node, only.devices, only.start) == ("n3", (0, 1, 2, 3, 4, 5), T0 + 2 * H + 40 * 60)


def test_refusals_at_submission_and_while_queued():
    nodes = [node("n1", gpu_type="A100"), node("n2", gpu_type="H100")]
    queue = [
        queued("big", 9, 1), queued("v100", 1, 1, gpu_type="V100"),
        queued("late", 1, 2, deadline_h=1), queued("stale", 1, 1, ago_h=2, deadline_h=0.5),
        queued("cpus", 0, 1, cpus=100), queued("memory", 0, 1, memory_gib=600),
        queued("together", 8, 1, cpus=64, memory_gib=600),
    ]
    assert {p.job: (p.action, p.reason) for p in plan(nodes, [], queue, T0)} == {
        "big": ("refuse", "no node can hold 9 GPUs: the largest nodes have 8 GPUs: ask for at most 8 GPUs "
                          "(request.gpus), or add a larger node to the pool file"),
        "v100": ("refuse", "no node has GPU type V100 (the pool has A100 on 1 node, H100 on 1 node): set "
                           "request.gpu_type to one of those, or add such nodes to the pool file"),
        "late": ("refuse", "deadline 01:00 UTC cannot be met even on an empty pool: started when submitted "
                           "(00:00 UTC) it would end 02:00 UTC (run time 2h: duration)"),
        "stale": ("refuse", "deadline became infeasible while queued: started now (00:00 UTC) it would end 01:00 UTC, "
                            "after its deadline 00:30 UTC (run time 1h: duration)"),
        # a request that splits evenly over nodes of the pool is told how (a multi-node job, a gang)
        "cpus": ("refuse", "no node can hold 100 CPUs: the largest nodes have 64 CPUs: ask for at most 64 CPUs "
                           "(request.cpus), spread it over 2 nodes (request.nodes: 2 with request.cpus: 50 per node), "
                           "or add a larger node to the pool file"),
        "memory": ("refuse", "no node can hold 600 GiB of memory: the largest nodes have 512 GiB"
                             ": ask for at most 512 GiB of memory (request.memory), spread it over 2 nodes "
                             "(request.nodes: 2 with request.cpus: 2, request.memory: 300 GiB per node), or add a larger "
                             "node to the pool file"),
        "together": ("refuse", "no node can hold 600 GiB of memory: the largest nodes have 512 GiB"
                               ": ask for at most 512 GiB of memory (request.memory), spread it over 2 nodes "
                               "(request.nodes: 2 with request.gpus: 4, request.cpus: 32, request.memory: 300 GiB per "
                               "node), or add a larger node to the pool file"),
    }
    mixed = [node("small", gpus=8, cpus=16), node("fat", gpus=2, cpus=128)]
    (p,) = plan(mixed, [], [queued("both", 8, 1, cpus=100)], T0)
    assert p.reason == ("no single node has 8 GPUs and 100 CPUs together "
                        "(largest: small with 8 GPUs, 16 CPUs, 512 GiB): ask for less, or add a larger node to the "
                        "pool file")


def test_gpu_type_chooses_the_node():
    nodes = [node("a1", gpu_type="A100"), node("h1", gpu_type="H100")]
    placements = plan(nodes, [], [queued("h", 2, 1, gpu_type="h100", memory_gib=16), queued("any", 1, 1)], T0)
    assert table(placements) == {
        "h": ("start", "h1", (0, 1), 0.0, 1.0,
              "starts now on h1, GPUs 0,1, 4 CPUs, 16 GiB; expected end 01:00 UTC (run time 1h: duration)"),
        "any": ("start", "a1", (0,), 0.0, 1.0,
                "starts now on a1, GPUs 0, 4 CPUs; expected end 01:00 UTC (run time 1h: duration)"),
    }
    (typed,) = plan(nodes, [running("r", "h1", range(8), 3)], [queued("t", 1, 1, gpu_type="H100")], T0)
    assert typed.reason == ("waiting for 1 GPU on one node (0 free on h1); earliest start 03:00 UTC on h1, "
                            "after job r ends")


def test_ageing_bound_puts_a_long_waiting_job_first():
    # L (10 h) has waited 7 h; S (10 min) has waited 1 h, so its expansion factor (7) beats L's (1.7)
    busy = [running("r", "n1", range(8), 1)]
    queue = [queued("L", 8, 10, ago_h=7), queued("S", 8, 1 / 6, ago_h=1)]
    aged = {p.job: (p.start - T0) / H for p in plan([node("n1")], busy, queue, T0)}
    assert aged == {"L": 1.0, "S": 11.0}
    unaged = {p.job: (p.start - T0) / H for p in plan([node("n1")], busy, queue, T0, age_limit_s=100 * H)}
    assert unaged == {"S": 1.0, "L": 1 + 1 / 6}


def test_staging_and_history_estimates_in_the_reason():
    job = queued("h", 1, 1.2, staging_s=600, source="history", note="90th percentile of 14 past runs")
    (p,) = plan([node("n1")], [], [job], T0)
    assert p.reason == ("starts now on n1, GPUs 0, 4 CPUs; expected end 01:22 UTC "
                        "(run time 1h12m: 90th percentile of 14 past runs + staging 10m)")
    assert p.end == T0 + 600 + 1.2 * H


def test_preferred_nodes_win_ties():
    job = queued("p", 1, 1)
    job = type(job)(**{**job.__dict__, "preferred_nodes": ("n2",)})
    (p,) = plan([node("n1"), node("n2")], [], [job], T0)
    assert (p.node, p.devices) == ("n2", (0,))


def test_a_job_waits_for_the_node_holding_its_inputs_when_it_frees_within_the_staging_it_saves():
    # n1 holds the job's inputs and frees at 00:10 (r1); n2 is free now.  Staging there takes 15 min: worth the wait.
    base = queued("p", 1, 1)
    wait = type(base)(**{**base.__dict__, "preferred_nodes": ("n1",), "locality_wait_s": 900.0})
    other = queued("q", 1, 1, ago_h=0.01)
    busy = [running("r1", "n1", range(8), 1 / 6)]
    got = table(plan([node("n1"), node("n2")], busy, [wait, other], T0))
    assert got["p"] == ("wait", "n1", (0,), 1 / 6, 1 / 6 + 1,
                        "waiting for n1, where its inputs are staged: it frees sooner than they would stage elsewhere "
                        "(about 15m); earliest start 00:10 UTC on n1, after job r1 ends")
    assert got["q"][:4] == ("start", "n2", (0,), 0.0)  # the free node goes to the next job
    # staging takes 5 min: cheaper than waiting 10 min for n1, so it starts on n2 now
    short = type(base)(**{**wait.__dict__, "locality_wait_s": 300.0})
    got = table(plan([node("n1"), node("n2")], busy, [short], T0))
    assert got["p"][:4] == ("start", "n2", (0,), 0.0)
    # a pool with no room now: the usual reason, and where its inputs are
    full = [*busy, running("r2", "n2", range(8), 1)]
    got = table(plan([node("n1"), node("n2")], full, [wait], T0))
    assert got["p"][5] == ("waiting for 1 GPU on one node (0 free on n1); earliest start 00:10 UTC on n1 (its "
                           "inputs are staged there), after job r1 ends")


def test_cpu_only_pool_and_memory():
    nodes = [node("c1", gpus=0, cpus=8, memory_gib=32)]
    queue = [queued("a", 0, 1, cpus=6, memory_gib=8), queued("b", 0, 1, cpus=4, memory_gib=8, ago_h=0.1)]
    got = table(plan(nodes, [], queue, T0, "fcfs"))
    assert got["b"][:5] == ("start", "c1", (), 0.0, 1.0)
    assert got["a"] == ("wait", "c1", (), 1.0, 2.0, "waiting for 6 CPUs on one node (4 free on c1); earliest start "
                        "01:00 UTC on c1, after job b ends")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"running": [running("r", "nx", [0], 1)]}, "running job r is on node 'nx', which is not in the pool"),
    ({"running": [running("r", "n1", [8], 1)]}, "running job r holds GPU 8 of n1, which has 8 GPU(s) numbered "
                                                "from 0 (each device once)"),
    ({"running": [running("r", "n1", [1], 1), running("s", "n1", [1, 2], 2)]},
     "running job s holds GPU(s) [1] of n1, which another running job holds"),
    ({"running": [running("r", "n1", [], 1, cpus=65)]},
     f"the running jobs on n1 hold more CPUs or memory than it has (65 CPUs, 0 bytes of 64, {512 * GIB})"),
    ({"policy": "sjf"}, "unknown policy 'sjf'; use one of e31, fcfs, easy, edf"),
    ({"depth": 0}, "depth must be at least 1 (got 0)"),
    ({"queued": [queued("a", 1, 1), queued("a", 1, 1)]}, "two running or queued jobs have the same id"),
])
def test_contradictory_input_is_refused(kwargs, message):
    args = {"nodes": [node("n1")], "running": [], "queued": [], "now": T0, **kwargs}
    with pytest.raises(PlanInputError) as info:
        plan(**args)
    assert str(info.value) == message
    assert info.value.exit_code == 2


def test_a_job_past_its_expected_end_still_holds_its_devices():
    overdue = running("r", "n1", range(8), -1)  # expected to end an hour ago
    (p,) = plan([node("n1")], [overdue], [queued("q", 1, 1)], T0)
    assert (p.action, p.start) == ("wait", T0 + 1)


def test_a_waiting_job_keeps_its_planned_node_between_equally_free_nodes():
    # n1 and n2 both free at 00:30; without a planned node the tie goes to n1 (pool order)
    busy = [running("r1", "n1", range(8), 0.5), running("r2", "n2", range(8), 0.5)]
    base = queued("p", 1, 1)
    got = table(plan([node("n1"), node("n2")], busy, [base], T0))
    assert got["p"][:4] == ("wait", "n1", (0,), 0.5)
    # planned on n2 by an earlier tick (its prefetch may be under way there): it stays, and no reason says staged
    kept = type(base)(**{**base.__dict__, "planned_node": "n2"})
    got = table(plan([node("n1"), node("n2")], busy, [kept], T0))
    assert got["p"][:4] == ("wait", "n2", (0,), 0.5)
    assert "staged" not in got["p"][5]
    # a sooner start elsewhere still wins
    sooner = [running("r1", "n1", range(8), 0.25), running("r2", "n2", range(8), 0.5)]
    got = table(plan([node("n1"), node("n2")], sooner, [kept], T0))
    assert got["p"][:4] == ("wait", "n1", (0,), 0.25)


def test_the_planned_node_is_read_back_from_the_placement_record_not_the_reason():
    """The scheduler carries a waiting run's reserved node in its
    ``placement`` parameter (PlacementRecord.planned), read by the node's
    prefetcher and the next plan; the reason only says it in words."""
    from types import SimpleNamespace

    from prefect.states import Scheduled

    from e31.flows.queue import QUEUED, PlacementRecord, planned_node, planned_start

    nodes = [node("gpu-1.rack.a"), node("n2")]
    busy = [running("r1", "gpu-1.rack.a", range(8), 2), running("r2", "n2", range(8), 3)]
    placements = plan(nodes, busy, [queued("A", 8, 1, ago_h=1 / 6), queued("B", 8, 1, ago_h=1 / 12)], T0, "easy")
    got = {p.job: (p.reserved, p.node, p.reason) for p in placements}
    assert got["A"] == (True, "gpu-1.rack.a", "waiting for 8 GPUs on one node (0 free on gpu-1.rack.a); earliest "
                                              "start 02:00 UTC on gpu-1.rack.a, after job r1 ends")
    assert got["B"][0] is False and "; estimated start 03:00 UTC (not reserved" in got["B"][2]
    by_job = {p.job: p for p in placements}
    assert (by_job["A"].ender, by_job["B"].ender) == ("r1", None)

    def run(name: str, placement: dict | None) -> SimpleNamespace:  # as the scheduler leaves it: words are anything
        return SimpleNamespace(state=Scheduled(name=name, message="x"), next_scheduled_start_time=None,
                               parameters={} if placement is None else {"placement": placement})

    queued_as = {j: run(QUEUED, PlacementRecord(planned=p.node if p.reserved else None).parameter())
                 for j, p in by_job.items()}
    assert planned_node(queued_as["A"]) == "gpu-1.rack.a"
    assert planned_start(queued_as["A"]).node == "gpu-1.rack.a"
    assert planned_node(queued_as["B"]) is None  # an estimate: no node's prefetcher takes it
    assert planned_node(run("Placed", queued_as["A"].parameters["placement"])) is None  # only a waiting run
    assert planned_node(run(QUEUED, None)) is None  # submitted, never planned
    assert planned_node(None) is None


def test_a_short_resource_is_named_on_the_node_the_job_is_planned_on_when_as_much_is_free_there():
    """Both nodes full, the reason must not say ``(0 free on n1)`` and then
    ``earliest start ... on n2``: with as much free on the node it is
    planned on, that node is named.  A node with more free is
    still named (what is short is judged on the most free)."""
    nodes = [node("n1"), node("n2")]
    busy = [running("a", "n1", range(8), 5), running("b", "n2", range(8), 2)]
    (only,) = plan(nodes, busy, [queued("X", 8, 1)], T0)
    assert only.reason == "waiting for 8 GPUs on one node (0 free on n2); earliest start 02:00 UTC on n2, after job b ends"
    busy = [running("a", "n1", range(6), 5), running("b", "n2", range(8), 2)]
    (only,) = plan(nodes, busy, [queued("X", 8, 1)], T0)
    assert only.reason == "waiting for 8 GPUs on one node (2 free on n1); earliest start 02:00 UTC on n2, after job b ends"


def test_a_job_asking_for_no_gpu_goes_to_a_node_without_gpus_when_one_starts_it_as_early():
    # the GPU node comes first in the pool file; the CPU job still lands on the CPU node, now and when it waits
    nodes = [node("g1", gpus=8), node("c1", gpus=0, cpus=16, memory_gib=64)]
    got = table(plan(nodes, [], [queued("cpu", 0, 1)], T0))
    assert got["cpu"][:4] == ("start", "c1", (), 0.0)
    busy = [running("r1", "c1", [], 1, cpus=16), running("r2", "g1", [], 1, cpus=64)]
    got = table(plan(nodes, busy, [queued("cpu", 0, 1)], T0))
    assert got["cpu"][:4] == ("wait", "c1", (), 1.0)
    # the GPU node takes it when it starts it sooner
    got = table(plan(nodes, busy[:1], [queued("cpu", 0, 1)], T0))
    assert got["cpu"][:4] == ("start", "g1", (), 0.0)


def test_a_deadline_keeps_the_return_reserve_before_it():
    """A job planned to end 2 s before its deadline must not be placed only for its run to be refused at its
    start, since the work must stop the return reserve (30 s) before the deadline.  The planner plans the work
    to end by then: refused when it cannot, at risk when it would not, and promoted to meet it."""
    from dataclasses import replace

    tight = replace(queued("tight", 1, 1, deadline_h=1 + 20 / H), return_s=30.0)  # 1 h of work, 1 h 20 s left
    (p,) = plan([node("n1")], [], [tight], T0)
    assert (p.action, p.reason) == ("refuse", "deadline 01:00:20 UTC cannot be met even on an empty pool: started "
                                              "when submitted (00:00 UTC) it would end 01:00 UTC (run time 1h: "
                                              "duration, and 30 s to return its output before the deadline)")
    fits = replace(tight, deadline=T0 + H + 40.0)
    (p,) = plan([node("n1")], [], [fits], T0)
    assert (p.action, p.reason) == ("start", "starts now on n1, GPUs 0, 4 CPUs; expected end 01:00 UTC (run time 1h: "
                                             "duration); ends 01:00 UTC, before its deadline 01:00:40 UTC")
    # behind a job ending at 00:00:20 it would end at 01:00:20, 20 s before the deadline: at risk of missing it
    busy = [running("r", "n1", range(8), 20 / H)]
    (p,) = plan([node("n1")], busy, [fits], T0)
    assert p.action == "wait" and p.reason.endswith("; ends 01:00:20 UTC, within the 30 s before its deadline "
                                                    "01:00:40 UTC kept to return its output: at risk"), p.reason
    # queued since 00:00 and not started by 00:00:30: its work would end within the reserve (not "after its
    # deadline" for an end before it)
    (p,) = plan([node("n1")], [], [fits], T0 + 30)
    assert (p.action, p.reason) == ("refuse", "deadline became infeasible while queued: started now (00:00:30 UTC) "
                                              "it would end 01:00:30 UTC, within the 30 s before its deadline "
                                              "01:00:40 UTC kept to return its output (run time 1h: duration)")


def test_a_job_asking_for_no_gpu_prefers_a_free_cpu_node_to_a_gap_on_a_busy_gpu_node():
    """A short CPU job that fits beside a long GPU job on the GPU node (it pushes back that node's free time by
    nothing) must not go there while the CPU node stands free."""
    nodes = [node("g", gpus=4, cpus=2, memory_gib=8), node("c", gpus=0, cpus=2, memory_gib=8)]
    busy = [running("long", "g", [0], 1, cpus=1)]
    got = table(plan(nodes, busy, [queued("cpu", 0, 20 / H, cpus=1)], T0))
    assert got["cpu"][:4] == ("start", "c", (), 0.0)
    # two of them: the CPU node takes one, the GPU node's free CPU the other (it starts as early there)
    got = table(plan(nodes, busy, [queued("a", 0, 20 / H, cpus=2, ago_h=0.01), queued("b", 0, 20 / H, cpus=1)], T0))
    assert (got["a"][:2], got["b"][:2]) == (("start", "c"), ("start", "g"))


@pytest.mark.parametrize("policy", ["e31", "easy", "fcfs"])
def test_a_replay_that_keeps_the_nodes_profiles_between_plans_decides_as_one_that_builds_them_anew(policy, monkeypatch):
    """``simulate`` keeps each node's capacity profile between plans while its running jobs stay the same
    (``plan(..., profiles=)``): 400 random jobs on 4 nodes, many waiting at once, give the same result
    (waits, slowdowns, ends, utilisation) as a replay whose plans build every profile anew."""
    import random
    from dataclasses import replace as copy_with

    import e31.flows.placement.simulate as sim
    from e31.flows.placement.simulate import SimJob

    rng = random.Random(7)
    nodes = [node(f"n{i}", gpus=8, cpus=32) for i in range(4)]
    jobs, t = [], T0
    for k in range(400):
        t += rng.expovariate(1 / 300)
        hours = rng.choice([0.1, 0.5, 1, 3, 8])
        job = queued(f"j{k:03d}", rng.choice([0, 1, 2, 4, 8]), hours, cpus=rng.choice([1, 4, 8]))
        jobs.append(SimJob(copy_with(job, submitted=t), actual_s=hours * H * rng.uniform(0.3, 1.0)))
    kept = sim.simulate(nodes, jobs, policy)
    real = sim.plan
    monkeypatch.setattr(sim, "plan", lambda *a, **k: real(*a, **{**k, "profiles": None}))
    anew = sim.simulate(nodes, jobs, policy)
    assert copy_with(kept, planning_s=0.0) == copy_with(anew, planning_s=0.0)
    assert kept.avg_wait_s > 600  # a queue that waits: the plans had choices to make
