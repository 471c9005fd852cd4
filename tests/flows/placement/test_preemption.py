"""Issue 36 item 2, the choice of victims (flows/placement/preemption.py): exact answers on small
pools, and properties on random ones (hypothesis) checked against a brute-force search."""

from __future__ import annotations

from itertools import combinations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e31.flows.placement.model import Node, RunningJob
from e31.flows.placement.preemption import (DAY_S, Need, PreemptionRules, choose_victims, lost_work,
                                            may_preempt)

GIB = 1024**3
NOW = 1_000_000.0
RULES = PreemptionRules(min_run_s=600.0, max_per_day=2)


def running(id_, node, devices, *, start=NOW - 3600, checkpoint_at=None, preemptible=True, priority=0, cpus=1,
            memory=GIB, preemptions=()):
    return RunningJob(id_, node, tuple(devices), cpus, memory, start, NOW + 3600, preemptible=preemptible,
                      checkpoint_at=checkpoint_at, priority=priority, preemptions=tuple(preemptions))


GPU8 = Node("g1", 8, 64, 512 * GIB, "H100")


def test_the_victim_losing_least_since_its_checkpoint_gives_way():
    jobs = [running("fresh-ckpt", "g1", range(0, 4), checkpoint_at=NOW - 60),   # loses 4 GPUs x 60 s
            running("old-ckpt", "g1", range(4, 8), checkpoint_at=NOW - 1800)]   # loses 4 GPUs x 1800 s
    got = choose_victims(Need(4, 1, GIB), [GPU8], jobs, NOW, RULES)
    assert got is not None
    assert (got.node, got.victims, got.devices, got.lost) == ("g1", ("fresh-ckpt",), (0, 1, 2, 3), 240.0)


def test_one_victim_that_loses_less_beats_two_smaller_ones():
    jobs = [running("a", "g1", [0, 1], checkpoint_at=NOW - 100),       # 200
            running("b", "g1", [2, 3], checkpoint_at=NOW - 100),       # 200
            running("c", "g1", [4, 5, 6, 7], checkpoint_at=NOW - 90)]  # 360 < 400
    got = choose_victims(Need(4, 1, 0), [GPU8], jobs, NOW, RULES)
    assert (got.victims, got.devices, got.lost) == (("c",), (4, 5, 6, 7), 360.0)


def test_equal_loss_goes_to_the_lower_priority_then_the_fewest_victims():
    jobs = [running("important", "g1", range(0, 4), checkpoint_at=NOW - 100, priority=5),
            running("minor", "g1", range(4, 8), checkpoint_at=NOW - 100, priority=1)]
    assert choose_victims(Need(4, 1, 0), [GPU8], jobs, NOW, RULES).victims == ("minor",)


def test_never_a_non_preemptible_job_one_under_its_minimum_run_or_one_at_its_daily_cap():
    jobs = [running("pinned", "g1", range(0, 4), preemptible=False, checkpoint_at=NOW - 1),
            running("young", "g1", range(4, 6), start=NOW - 599),
            running("capped", "g1", range(6, 8), preemptions=(NOW - 100, NOW - DAY_S + 10))]
    assert [may_preempt(j, NOW, RULES) for j in jobs] == [False, False, False]
    assert choose_victims(Need(2, 1, 0), [GPU8], jobs, NOW, RULES) is None
    # a preemption older than a day no longer counts; at 600 s the minimum run is met
    older = running("capped", "g1", range(6, 8), preemptions=(NOW - 100, NOW - DAY_S))
    assert may_preempt(older, NOW, RULES) and may_preempt(running("y", "g1", [4], start=NOW - 600), NOW, RULES)
    assert choose_victims(Need(2, 1, 0), [GPU8], [*jobs[:2], older], NOW, RULES).victims == ("capped",)


def test_nothing_is_preempted_for_a_job_that_fits_somewhere_now():
    other = Node("g2", 8, 64, 512 * GIB, "H100")
    jobs = [running("a", "g1", range(0, 8))]
    assert choose_victims(Need(8, 1, 0), [GPU8, other], jobs, NOW, RULES) is None
    # a node of another GPU type does not count as room
    t4 = Node("t4", 8, 64, 512 * GIB, "T4")
    got = choose_victims(Need(8, 1, 0, "h100"), [GPU8, t4], jobs, NOW, RULES)
    assert (got.node, got.victims) == ("g1", ("a",))


def test_cpus_and_memory_count_as_well_as_devices():
    cpu = Node("c1", 0, 8, 16 * GIB)
    jobs = [running("small", "c1", [], cpus=2, memory=12 * GIB, checkpoint_at=NOW - 10),
            running("wide", "c1", [], cpus=6, memory=1 * GIB, checkpoint_at=NOW - 20)]
    assert choose_victims(Need(0, 2, 8 * GIB), [cpu], jobs, NOW, RULES).victims == ("small",)  # memory
    assert choose_victims(Need(0, 6, 0), [cpu], jobs, NOW, RULES).victims == ("wide",)  # cpus: small's 2 are too few
    assert lost_work(jobs[0], NOW) == 20.0 and lost_work(jobs[1], NOW) == 120.0  # CPU-seconds without GPUs


# -- properties --------------------------------------------------------------------------------------

@st.composite
def pools(draw):
    """Busy pools: nodes mostly full, most running jobs preemptible and past their minimum run, so that
    the job asking for room fits nowhere as things stand and some victim sets make room."""
    nodes = [Node(f"n{i}", draw(st.integers(0, 4)), draw(st.integers(1, 8)), draw(st.integers(1, 8)) * GIB,
                  draw(st.sampled_from([None, None, "a"]))) for i in range(draw(st.integers(1, 3)))]
    jobs = []
    for node in nodes:
        free = list(range(node.gpus))
        cpus, memory = node.cpus, node.memory
        for k in range(draw(st.integers(0, 5))):
            take = draw(st.integers(0, len(free)))
            c = draw(st.integers(0, cpus))
            m = draw(st.integers(0, memory // GIB)) * GIB
            if take == 0 and c == 0:
                continue
            devices, free = free[:take], free[take:]
            cpus, memory = cpus - c, memory - m
            jobs.append(running(f"{node.name}-j{k}", node.name, devices, cpus=c, memory=m,
                                start=NOW - draw(st.sampled_from([100, 700, 5000, 5000])),
                                checkpoint_at=draw(st.sampled_from([None, NOW - 50, NOW - 400])),
                                preemptible=draw(st.sampled_from([True, True, True, False])),
                                priority=draw(st.integers(0, 2)),
                                preemptions=draw(st.sampled_from([(), (), (NOW - 10,), (NOW - 10, NOW - 20)]))))
    biggest = max(nodes, key=lambda n: n.gpus)
    need = Need(draw(st.integers(0, biggest.gpus)), draw(st.integers(1, biggest.cpus)),
                draw(st.integers(0, biggest.memory // GIB)) * GIB, draw(st.sampled_from([None, None, "a"])))
    return nodes, jobs, need


def _fits(node, need, held):
    busy = {d for j in held for d in j.devices}
    return (node.gpus - len(busy) >= need.gpus and node.cpus - sum(j.cpus for j in held) >= need.cpus
            and node.memory - sum(j.memory for j in held) >= need.memory)


def _eligible(node, need):
    return need.gpu_type is None or (node.gpu_type or "").lower() == need.gpu_type.lower()


def _brute(nodes, jobs, need):
    """Every minimal allowed victim set on every eligible node, with its key."""
    found = []
    for index, node in enumerate(nodes):
        if not _eligible(node, need):
            continue
        here = [j for j in jobs if j.node == node.name]
        allowed = [j for j in here if may_preempt(j, NOW, RULES)]
        for size in range(1, len(allowed) + 1):
            for chosen in combinations(allowed, size):
                ids = {j.id for j in chosen}
                if not _fits(node, need, [j for j in here if j.id not in ids]):
                    continue
                if any(_fits(node, need, [j for j in here if j.id not in ids - {v}]) for v in ids):
                    continue  # not minimal
                key = (sum(lost_work(j, NOW) for j in chosen), max(j.priority for j in chosen), size, index,
                       sorted(ids))
                found.append((key, node.name, ids))
    return found


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pools())
def test_the_choice_is_allowed_sufficient_minimal_and_the_best_there_is(case):
    nodes, jobs, need = case
    got = choose_victims(need, nodes, jobs, NOW, RULES)
    fits_now = any(_eligible(n, need) and _fits(n, need, [j for j in jobs if j.node == n.name]) for n in nodes)
    found = _brute(nodes, jobs, need)
    if fits_now or not found:
        assert got is None  # nothing for a job that can start without it; nothing when no set makes room
        return
    assert got is not None
    by_id = {j.id: j for j in jobs}
    node = next(n for n in nodes if n.name == got.node)
    victims = [by_id[v] for v in got.victims]
    assert all(v.node == got.node and may_preempt(v, NOW, RULES) for v in victims)  # allowed
    rest = [j for j in jobs if j.node == got.node and j.id not in got.victims]
    assert _fits(node, need, rest)  # sufficient
    assert len(got.devices) == need.gpus and not set(got.devices) & {d for j in rest for d in j.devices}
    assert all(not _fits(node, need, rest + [v]) for v in victims)  # minimal: none could stay
    assert got.lost == sum(lost_work(v, NOW) for v in victims)
    best = min(found)
    assert (best[1], best[2]) == (got.node, set(got.victims))  # the best by the documented order


# -- the plan's preemptions ----------------------------------------------------------------------------

def queued(id_, gpus, *, deadline=None, runtime_s=3600.0):
    from e31.flows.placement.model import QueuedJob

    return QueuedJob(id_, id_, gpus, 1, GIB, NOW - 60, runtime_s, 2 * runtime_s, gpu_type=None, deadline=deadline)


def _planned(nodes, jobs, waiting):
    from e31.flows.placement.planner import plan
    from e31.flows.placement.preemption import plan_preemptions

    placements = plan(nodes, jobs, waiting, NOW, explain=False)
    return [(p.job, p.preemption.node, p.preemption.victims, p.preemption.devices)
            for p in plan_preemptions(nodes, jobs, waiting, placements, NOW, RULES)]


def long_run(id_, node, devices, **kw):
    return RunningJob(id_, node, tuple(devices), 1, GIB, NOW - 3600, NOW + 10 * 3600, **kw)


def test_a_deadline_job_on_a_full_pool_preempts_and_one_with_slack_does_not():
    nodes = [GPU8]
    hog = long_run("hog", "g1", range(8), preemptible=True, checkpoint_at=NOW - 300)
    urgent = queued("urgent", 8, deadline=NOW + 2 * 3600)
    assert _planned(nodes, [hog], [urgent]) == [("urgent", "g1", ("hog",), tuple(range(8)))]
    relaxed = queued("relaxed", 8, deadline=NOW + 20 * 3600)  # fits after hog ends: waits, preempts nothing
    assert _planned(nodes, [hog], [relaxed]) == []
    plain = queued("plain", 8)  # no deadline: waits
    assert _planned(nodes, [hog], [plain]) == []


def test_a_non_preemptible_or_young_job_is_never_preempted_for_a_deadline():
    urgent = queued("urgent", 8, deadline=NOW + 2 * 3600)
    pinned = long_run("pinned", "g1", range(8), preemptible=False, checkpoint_at=NOW - 300)
    assert _planned([GPU8], [pinned], [urgent]) == []
    young = RunningJob("young", "g1", tuple(range(8)), 1, GIB, NOW - 300, NOW + 10 * 3600, preemptible=True)
    assert _planned([GPU8], [young], [urgent]) == []


def test_two_deadline_jobs_at_risk_take_different_victims_and_a_job_started_now_is_none():
    g2 = Node("g2", 8, 64, 512 * GIB, "H100")
    a = long_run("a", "g1", range(8), preemptible=True, checkpoint_at=NOW - 100)
    b = long_run("b", "g2", range(4), preemptible=True, checkpoint_at=NOW - 200)
    first = queued("first", 8, deadline=NOW + 2 * 3600)
    second = queued("second", 8, deadline=NOW + 2 * 3600 + 60)
    small = queued("small", 4)  # starts now on g2's free half; the plan keeps it
    got = _planned([GPU8, g2], [a, b], [first, second, small])
    assert got == [("first", "g1", ("a",), tuple(range(8)))]  # second: g2 holds b and small, small is not a victim


def test_a_job_a_plan_starts_by_a_preemption_is_never_the_victim_of_the_next_even_with_no_minimum_run():
    """min_run 0: ``running`` has run 100 s; two deadline jobs of 8 GPUs are at risk.  The first
    (itself preemptible) preempts ``running``; the second finds no victim: the first has just started."""
    from e31.flows.placement.model import QueuedJob
    from e31.flows.placement.planner import plan
    from e31.flows.placement.preemption import plan_preemptions

    victim = running("running", "g1", range(8), start=NOW - 100, checkpoint_at=NOW - 10)
    first = QueuedJob("d1", "d1", 8, 1, GIB, NOW - 60, 3600.0, 3600.0, deadline=NOW + 4000, preemptible=True)
    second = QueuedJob("d2", "d2", 8, 1, GIB, NOW - 30, 3600.0, 3600.0, deadline=NOW + 4000)
    rules = PreemptionRules(min_run_s=0.0)
    placements = plan([GPU8], [victim], [first, second], NOW, explain=False)
    got = plan_preemptions([GPU8], [victim], [first, second], placements, NOW, rules)
    assert [(c.job, c.preemption.victims) for c in got] == [("d1", ("running",))]


def test_a_deadline_job_held_back_by_the_minimum_run_is_told_when_it_preempts_and_whom():
    """A young victim (300 s into a 600 s minimum run) is preempted once it reaches it, 300 s from now,
    in time for the deadline: the queue's reason names it and that time.  A victim at its daily cap
    gives the cap as the reason; a deadline job with slack gets no word."""
    from e31.flows.placement.planner import plan
    from e31.flows.placement.preemption import deferred_preemptions, plan_preemptions

    def deferred(jobs, waiting, rules=RULES):
        placements = plan([GPU8], jobs, waiting, NOW, explain=False)
        planned = plan_preemptions([GPU8], jobs, waiting, placements, NOW, rules)
        return deferred_preemptions([GPU8], jobs, waiting, placements, planned, NOW, rules)

    young = RunningJob("young", "g1", tuple(range(8)), 1, GIB, NOW - 300, NOW + 10 * 3600, preemptible=True)
    urgent = queued("urgent", 8, deadline=NOW + 2 * 3600)
    [(at, chosen)] = deferred([young], [urgent]).values()
    assert (at, chosen.victims, chosen.node) == (NOW + 300, ("young",), "g1")
    capped = RunningJob("capped", "g1", tuple(range(8)), 1, GIB, NOW - 3600, NOW + 10 * 3600, preemptible=True,
                        preemptions=(NOW - 100, NOW - 50))
    assert deferred([capped], [urgent]) == {
        "urgent": "no preemption: the jobs on its way have been preempted the pool's max_per_day (2) times in 24 hours"}
    assert deferred([young], [queued("relaxed", 8, deadline=NOW + 20 * 3600)]) == {}
    late = queued("late", 8, deadline=NOW + 3600 + 200)  # 300 s from now is too late for its hour of work
    assert deferred([young], [late]) == {}
