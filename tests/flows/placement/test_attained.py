"""Issue 36 item 2, jobs that declare no duration ordered by attained service
(flows/placement/attained.py and its use by the planner, the preemptions and the replay), worked by hand."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e31.flows.placement.attained import level, rank, ranks_above, starving
from e31.flows.placement.model import Node, QueuedJob, RunningJob
from e31.flows.placement.planner import plan
from e31.flows.placement.preemption import PreemptionRules, plan_preemptions
from e31.flows.placement.simulate import SimJob, simulate

GIB = 1024**3
NOW = 1_000_000.0
RULES = PreemptionRules(min_run_s=600.0, max_per_day=None)
GPU8 = Node("g1", 8, 64, 512 * GIB, "H100")


def undeclared(id_, gpus, *, submitted=NOW - 60, attained_s=0.0, waiting_since=None, limit_s=10 * 3600.0,
               preemptible=True):
    """A job that declared only a limit (its estimate is its limit)."""
    return QueuedJob(id_, id_, gpus, 1, GIB, submitted, limit_s, limit_s, runtime_source="limit",
                     preemptible=preemptible, attained_s=attained_s, waiting_since=waiting_since)


def declared(id_, gpus, runtime_s, *, submitted=NOW - 60):
    return QueuedJob(id_, id_, gpus, 1, GIB, submitted, runtime_s, 2 * runtime_s, runtime_source="duration")


def running(id_, devices, *, start, attained_s=0.0, no_duration=True, preemptible=True, end=NOW + 10 * 3600,
            checkpoint_at=NOW - 100):
    return RunningJob(id_, "g1", tuple(devices), 1, GIB, start, end, preemptible=preemptible,
                      attained_s=attained_s, no_duration=no_duration, checkpoint_at=checkpoint_at)


def test_levels_cut_at_one_and_ten_gpu_hours():
    assert [level(s) for s in (0, 3_599, 3_600, 35_999, 36_000, 10**9)] == [0, 0, 1, 1, 2, 2]


def test_a_job_starves_after_waiting_eight_times_what_it_ran_and_then_ranks_first():
    # 4 GPUs x 3,000 s = 12,000 GPU-seconds: level 1, it ran 3,000 s
    served = undeclared("served", 4, attained_s=12_000.0, waiting_since=NOW - 23_999)
    assert (starving(served, NOW), rank(served, NOW)) == (False, (1, 1))
    assert (starving(served, NOW + 1), rank(served, NOW + 1)) == (True, (0, 0))
    fresh = undeclared("fresh", 4)  # never ran: level 0, not "starving"
    assert (starving(fresh, NOW + 10**6), rank(fresh, NOW + 10**6)) == (False, (1, 0))


def test_the_least_served_job_goes_first_whatever_its_arrival():
    nodes = [GPU8]
    hog = running("hog", range(8), start=NOW - 3600, no_duration=False, preemptible=False, end=NOW + 3600)
    old = undeclared("old", 8, submitted=NOW - 7200, attained_s=8 * 3_000.0, waiting_since=NOW - 600)
    new = undeclared("new", 8, submitted=NOW - 60)
    order = [p.job for p in plan(nodes, [hog], [old, new], NOW, explain=False)]
    assert order == ["new", "old"]
    starved = undeclared("old", 8, submitted=NOW - 30_000, attained_s=8 * 3_000.0, waiting_since=NOW - 24_000)
    assert [p.job for p in plan(nodes, [hog], [starved, new], NOW, explain=False)] == ["old", "new"]


def test_an_undeclared_preemptible_job_starts_in_room_reserved_for_a_later_job():
    nodes = [GPU8]
    half = running("half", range(4), start=NOW - 600, no_duration=False, preemptible=False, end=NOW + 3600)
    big = declared("big", 8, 3600.0, submitted=NOW - 600)  # reserved at NOW + 3600 on all 8 GPUs
    free = undeclared("free", 4)
    got = {p.job: (p.action, p.start) for p in plan(nodes, [half], [big, free], NOW, explain=False)}
    assert got == {"big": ("wait", NOW + 3600), "free": ("start", NOW)}
    # the same job, not preemptible: planned on its limit (10 h), it cannot use the 1-hour gap
    pinned = undeclared("free", 4, preemptible=False)
    got = {p.job: (p.action, p.start) for p in plan(nodes, [half], [big, pinned], NOW, explain=False)}
    assert got["free"] == ("wait", NOW + 2 * 3600)


def _preemptions(running_jobs, waiting):
    placements = plan([GPU8], running_jobs, waiting, NOW, explain=False)
    return [(p.job, p.preemption.victims) for p in plan_preemptions([GPU8], running_jobs, waiting, placements, NOW,
                                                                    RULES)]


def test_a_waiting_job_preempts_running_jobs_two_levels_deeper_only():
    deep = running("deep", range(8), start=NOW - 4_500)  # 8 x 4,500 = 36,000 GPU-s: level 2
    assert (ranks_above(undeclared("new", 8), deep, NOW),
            ranks_above(undeclared("new", 8, attained_s=3_600.0, waiting_since=NOW), deep, NOW)) == (True, False)
    assert _preemptions([deep], [undeclared("new", 8)]) == [("new", ("deep",))]
    one_deeper = running("one", range(8), start=NOW - 4_499)  # 35,992 GPU-s: level 1, one below level 0
    assert _preemptions([one_deeper], [undeclared("new", 8)]) == []
    same = running("same", range(8), start=NOW - 400)  # 3,200 GPU-s: level 0, as the newcomer
    assert _preemptions([same], [undeclared("new", 8)]) == []
    served = undeclared("served", 8, attained_s=4_000.0, waiting_since=NOW - 60)  # level 1
    assert _preemptions([deep], [served]) == []
    # the same job once it has waited 8 x its 500 s run: it starves, ranks as level 0 and preempts
    starving_job = undeclared("served", 8, attained_s=4_000.0, waiting_since=NOW - 4_000)
    assert _preemptions([deep], [starving_job]) == [("served", ("deep",))]
    declared_victim = running("timed", range(8), start=NOW - 4_500, no_duration=False)
    assert _preemptions([declared_victim], [undeclared("new", 8)]) == []
    young = running("young", range(8), start=NOW - 500, attained_s=40_000.0)  # level 2, under min_run
    assert _preemptions([young], [undeclared("new", 8)]) == []


def test_attained_service_preempts_only_after_an_hour_of_run_and_a_deadline_after_min_run():
    """A job 8 GPUs wide passes the deepest level (10 GPU-hours) after 75 minutes of its first run, but
    with earlier runs it may be there at once: it gives way for attained service only once its current
    run reaches the pool's attained_min_run (1 hour by default), and for a deadline at risk once it
    reaches min_run (10 minutes)."""
    for ran, victims in ((3_599, []), (3_600, [("new", ("deep",))])):
        deep = running("deep", range(8), start=NOW - ran, attained_s=40_000.0)  # level 2 whatever this run
        assert _preemptions([deep], [undeclared("new", 8)]) == victims, ran
    deep = running("deep", range(8), start=NOW - 600, attained_s=40_000.0, checkpoint_at=NOW - 10)
    urgent = QueuedJob("urgent", "urgent", 8, 1, GIB, NOW - 60, 3600.0, 7200.0, runtime_source="duration",
                       deadline=NOW + 3700.0)
    assert _preemptions([deep], [urgent]) == [("urgent", ("deep",))]
    assert _preemptions([deep], [undeclared("new", 8)]) == []
    shorter = PreemptionRules(min_run_s=600.0, max_per_day=None, attained_min_run_s=600.0)
    placements = plan([GPU8], [deep], [undeclared("new", 8)], NOW, explain=False)
    assert [(p.job, p.preemption.victims) for p in plan_preemptions(
        [GPU8], [deep], [undeclared("new", 8)], placements, NOW, shorter)] == [("new", ("deep",))]


def test_a_job_is_preempted_for_attained_service_only_soon_after_a_checkpoint():
    """The deeper job would lose the seconds since its newest checkpoint: 301 s is more than the 300 s
    allowed, 300 s is not; with no checkpoint it would lose its 4,500 s since its start.  A deadline at
    risk is not held to the bound (tests/flows/placement/test_preemption.py)."""
    for checkpoint_at, victims in ((NOW - 301, []), (NOW - 300, [("new", ("deep",))]), (None, [])):
        deep = running("deep", range(8), start=NOW - 4_500, checkpoint_at=checkpoint_at)
        assert _preemptions([deep], [undeclared("new", 8)]) == victims, checkpoint_at
    deep = running("deep", range(8), start=NOW - 4_500, checkpoint_at=None)
    unbounded = PreemptionRules(min_run_s=600.0, max_per_day=None, attained_loss_s=None)
    placements = plan([GPU8], [deep], [undeclared("new", 8)], NOW, "e31", explain=False)
    assert [(c.job, c.preemption.victims) for c in plan_preemptions(
        [GPU8], [deep], [undeclared("new", 8)], placements, NOW, unbounded)] == [("new", ("deep",))]


def test_a_short_job_preempts_a_long_one_and_both_finish_in_a_replay():
    """One node of 8 GPUs.  A (8 GPUs, no duration, limit 10 h) really runs 10,800 s from 0; B (the
    same declaration) arrives at 5,000 and runs 1,000 s.  Both checkpoint every 1,800 s.  At 5,000 A
    has 40,000 GPU-seconds (level 2), B none (level 0), but A would lose the 1,400 s since its
    checkpoint at 3,600, more than 300 s: B waits.  The replay plans again 1 s after A's checkpoint
    at 5,400: A is preempted keeping 5,400 s and losing 8 GPU-seconds; B runs 5,401-6,401; A starts
    again at 6,401 with 5,400 s to do and ends at 11,801.  Mean completion (11,801 + 1,401) / 2 =
    6,601 s.  Without preemption B waits for A: 10,800 and 11,800, mean (10,800 + 6,800) / 2 =
    8,800 s."""
    one = [Node("g", 8, 64, 512 * GIB)]
    t0 = 1_767_225_600.0

    def job(id_, at, actual):
        return SimJob(QueuedJob(id_, id_, 8, 1, GIB, t0 + at, 36_000.0, 36_000.0, runtime_source="limit"),
                      actual, preemptible=True)

    jobs = [job("a", 0, 10_800.0), job("b", 5_000, 1_000.0)]
    got = simulate(one, jobs, preemption=RULES, checkpoint_every_s=1800.0)
    assert ({k: v - t0 for k, v in got.ends.items()}, got.preemptions, got.lost_gpu_hours,
            got.mean_completion_s) == ({"a": 11_801.0, "b": 6_401.0}, 1, pytest.approx(8 / 3600), 6_601.0)
    without = simulate(one, jobs)
    assert ({k: v - t0 for k, v in without.ends.items()}, without.preemptions,
            without.mean_completion_s) == ({"a": 10_800.0, "b": 11_800.0}, 0, 8_800.0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from([1, 2, 4, 8]), st.integers(0, 20_000), st.integers(60, 40_000)),
                min_size=1, max_size=25),
       st.sampled_from([600.0, 1800.0]))
def test_every_job_of_a_replay_finishes_and_each_preemption_loses_at_most_the_bound_and_its_restart(
        specs, every):
    """Random jobs that declare no duration on two nodes of 8 GPUs, no deadlines (so every preemption is
    for attained service): every job ends, after its actual run time (the work kept by checkpoints is
    not done twice, the rest is), and the GPU-seconds lost are at most, per preemption, 8 GPUs x
    (the 300 s bound + the 1 s the replay plans after a checkpoint + the 60 s restart); the jobs stage
    nothing here (a staging time is paid again at each restart too)."""
    two = [Node("a", 8, 64, 512 * GIB), Node("b", 8, 64, 512 * GIB)]
    t0 = 1_767_225_600.0
    jobs = [SimJob(QueuedJob(f"j{i:02d}", f"j{i:02d}", gpus, 1, GIB, t0 + at, 200_000.0, 200_000.0,
                             runtime_source="limit"), float(run), preemptible=True)
            for i, (gpus, at, run) in enumerate(specs)]
    got = simulate(two, jobs, preemption=RULES, checkpoint_every_s=every, restart_cost_s=60.0)
    assert sorted(got.ends) == sorted(j.job.id for j in jobs)
    for j in jobs:
        assert got.ends[j.job.id] - j.job.submitted >= j.actual_s
    assert got.lost_gpu_hours * 3600 <= got.preemptions * 8 * (300.0 + 1.0 + 60.0) + 1e-6


def test_a_replay_refuses_a_checkpoint_interval_under_a_second_and_a_loss_bound_under_its_wake():
    from e31.flows.placement.model import PlanInputError

    one = [Node("g", 8, 64, 512 * GIB)]
    jobs = [SimJob(undeclared("a", 8, submitted=NOW), 60.0, preemptible=True)]
    for every in (1e-7, -1.0, 0.5):  # a wake per checkpoint: 1e-7 s after 1.7e9 s is the same float, forever
        with pytest.raises(PlanInputError) as caught:
            simulate(one, jobs, preemption=RULES, checkpoint_every_s=every)
        assert str(caught.value) == f"checkpoint_every_s must be at least 1 s, got {every!r}"
    with pytest.raises(PlanInputError) as caught:
        simulate(one, jobs, preemption=PreemptionRules(attained_loss_s=0.5), checkpoint_every_s=60.0)
    assert str(caught.value) == ("preemption.attained_loss_s must be at least 1 s (the replay plans 1 s after a "
                                 "checkpoint), got 0.5")
    assert simulate(one, jobs, preemption=RULES, checkpoint_every_s=1.0).ends == {"a": NOW + 60.0}


def test_a_job_preempted_for_a_deadline_and_then_refused_counts_as_refused_and_its_run_as_busy():
    """One node of 8 GPUs.  A (deadline 10,500, runs 10,000 s, preemptible) starts at 0; B (deadline
    3,000, runs 1,500 s) arrives at 1,000 and would miss its deadline behind A: A is preempted (no
    checkpoints: it loses its 1,000 s x 8 GPUs, 2.22 GPU-hours), B runs 1,000-2,500, and A, with
    10,000 s still to do, can no longer meet its deadline: refused.  Busy 8 x (1,000 + 1,500) over
    8 x 2,500 available: utilisation 1.0."""
    one = [Node("g1", 8, 64, 512 * GIB, "H100")]
    t0 = 1_767_225_600.0
    a = QueuedJob("a", "a", 8, 1, GIB, t0, 1e4, 1e4, deadline=t0 + 10_500)
    b = QueuedJob("b", "b", 8, 1, GIB, t0 + 1000, 1500.0, 1500.0, deadline=t0 + 3000)
    got = simulate(one, [SimJob(a, 1e4, preemptible=True), SimJob(b, 1500.0)], preemption=RULES)
    assert (got.jobs, got.refused, {k: v - t0 for k, v in got.ends.items()}, got.preemptions,
            got.lost_gpu_hours, got.utilization, got.deadlines_met) == (
        1, 1, {"b": 2500.0}, 1, pytest.approx(8000 / 3600), 1.0, 1)


def test_the_overhead_budget_bounds_what_a_job_s_preemptions_for_attained_service_cost_it():
    """Served 10 h (36,000 s), 10 s since its checkpoint: this preemption costs 60 s of restart + 10 s,
    under 1% (360 s); after five earlier ones, each counted at 60 + 300 s, 1,870 s is over it; 20
    minutes served is under budget for even one.  No bound (the default): always allowed."""
    from e31.flows.placement.preemption import within_overhead

    budget = PreemptionRules(max_overhead=0.01)
    served = running("long", range(8), start=NOW - 36_000, checkpoint_at=NOW - 10)
    again = RunningJob("again", "g1", tuple(range(8)), 1, GIB, NOW - 36_000, NOW + 3600, preemptible=True,
                       checkpoint_at=NOW - 10, preemptions=(1.0, 2.0, 3.0, 4.0, 5.0), no_duration=True)
    young = running("young", range(8), start=NOW - 1_200, checkpoint_at=NOW - 10)
    assert [within_overhead(j, NOW, budget) for j in (served, again, young)] == [True, False, False]
    assert [within_overhead(j, NOW, RULES) for j in (served, again, young)] == [True, True, True]
