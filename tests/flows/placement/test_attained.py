"""Issue 36 item 2, jobs that declare no duration ordered by attained service
(flows/placement/attained.py and its use by the planner, the preemptions and the replay), worked by hand."""

from __future__ import annotations

import pytest

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


def running(id_, devices, *, start, attained_s=0.0, no_duration=True, preemptible=True, end=NOW + 10 * 3600):
    return RunningJob(id_, "g1", tuple(devices), 1, GIB, start, end, preemptible=preemptible,
                      attained_s=attained_s, no_duration=no_duration)


def test_levels_cut_at_one_and_ten_gpu_hours():
    assert [level(s) for s in (0, 3_599, 3_600, 35_999, 36_000, 10**9)] == [0, 0, 1, 1, 2, 2]


def test_a_job_starves_after_waiting_twice_what_it_ran_and_then_ranks_first():
    # 4 GPUs x 3,000 s = 12,000 GPU-seconds: level 1, it ran 3,000 s
    served = undeclared("served", 4, attained_s=12_000.0, waiting_since=NOW - 5_999)
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
    starved = undeclared("old", 8, submitted=NOW - 7200, attained_s=8 * 3_000.0, waiting_since=NOW - 6_000)
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


def test_a_waiting_job_preempts_running_jobs_of_a_deeper_level_only():
    deep = running("deep", range(8), start=NOW - 3600)  # 8 x 3,600 = 28,800 GPU-s: level 1
    assert (ranks_above(undeclared("new", 8), deep, NOW),
            ranks_above(undeclared("new", 8, attained_s=3_600.0, waiting_since=NOW), deep, NOW)) == (True, False)
    assert _preemptions([deep], [undeclared("new", 8)]) == [("new", ("deep",))]
    same = running("same", range(8), start=NOW - 400)  # 3,200 GPU-s: level 0, as the newcomer
    assert _preemptions([same], [undeclared("new", 8)]) == []
    served = undeclared("served", 8, attained_s=4_000.0, waiting_since=NOW - 60)  # level 1 as well
    assert _preemptions([deep], [served]) == []
    declared_victim = running("timed", range(8), start=NOW - 3600, no_duration=False)
    assert _preemptions([declared_victim], [undeclared("new", 8)]) == []
    young = running("young", range(8), start=NOW - 500, attained_s=40_000.0)  # level 2, under min_run
    assert _preemptions([young], [undeclared("new", 8)]) == []


def test_a_short_job_preempts_a_long_one_and_both_finish_in_a_replay():
    """One GPU.  A (no duration, limit 10 h) really runs 10,800 s from 0; B (the same declaration)
    arrives at 7,000 and runs 600 s.  Both checkpoint every 1,800 s.  At 7,000 A has 7,000
    GPU-seconds (level 1), B none (level 0): A is preempted keeping 5,400 s (its checkpoint at
    5,400), losing 1,600 GPU-seconds; B runs 7,000-7,600; A starts again at 7,600 with 5,400 s to
    do and ends at 13,000.  Mean completion (13,000 + 600) / 2 = 6,800 s.  Without preemption B
    waits for A: 10,800 and 11,400, mean (10,800 + 4,400) / 2 = 7,600 s."""
    one = [Node("g", 1, 8, 64 * GIB)]
    t0 = 1_767_225_600.0

    def job(id_, at, actual):
        return SimJob(QueuedJob(id_, id_, 1, 1, GIB, t0 + at, 36_000.0, 36_000.0, runtime_source="limit"),
                      actual, preemptible=True)

    jobs = [job("a", 0, 10_800.0), job("b", 7_000, 600.0)]
    got = simulate(one, jobs, preemption=RULES, checkpoint_every_s=1800.0)
    assert ({k: v - t0 for k, v in got.ends.items()}, got.preemptions, got.lost_gpu_hours,
            got.mean_completion_s) == ({"a": 13_000.0, "b": 7_600.0}, 1, pytest.approx(1_600 / 3600), 6_800.0)
    without = simulate(one, jobs)
    assert ({k: v - t0 for k, v in without.ends.items()}, without.preemptions,
            without.mean_completion_s) == ({"a": 10_800.0, "b": 11_400.0}, 0, 7_600.0)
