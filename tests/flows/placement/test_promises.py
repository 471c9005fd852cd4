"""The promises a plan keeps: a backfill never delays a reservation ahead of it, even run to its
limit; a node is not left idle while a queued job could use it harmlessly; ties and short jobs
are ordered as a person expects; ``e31 plan --now`` judges deadlines as of ``--now``."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e31.flows.placement import POLICIES, Node, QueuedJob, RunningJob, plan
from e31.flows.placement.capacity import Capacity
from e31.flows.placement.policy import expansion_factor
from e31.flows.placement.simulate import SimJob, simulate
from tests.flows.placement.helpers import GIB, H, T0, node, queued, running
from tests.flows.placement.test_properties import FEW, busy, pools, queues

MIN = 60.0


def by_job(placements):
    return {p.job: p for p in placements}


def job(job_id: str, gpus: int, runtime_s: float, limit_s: float, *, ago_s: float = 0.0, **more) -> QueuedJob:
    return QueuedJob(id=job_id, name=job_id, gpus=gpus, cpus=1, memory=0, submitted=T0 - ago_s,
                     runtime_s=runtime_s, limit_s=limit_s, runtime_source="duration", **more)


# -- a backfill is judged on its limit and its overheads -------------------------------------------

def test_a_backfill_that_would_overrun_into_a_reservation_waits():
    # n1: 2 of 4 GPUs busy for an hour; "head" (4 GPUs) holds the reservation at T0+1h; each candidate's
    # estimate (30 min) fits the hour, but only "fits" can run to its limit before the reservation
    nodes = [node("n1", gpus=4)]
    busy_ = [running("a", "n1", (0, 1), until_h=1)]
    head = job("head", 4, H, 2 * H, ago_s=H)
    overruns = job("overruns", 2, 30 * MIN, 2 * H)  # duration 30m, limit 2h
    fits = job("fits", 2, 30 * MIN, 50 * MIN)
    for policy in ("e31", "easy"):
        got = by_job(plan(nodes, busy_, [head, overruns], T0, policy))
        assert (got["head"].action, got["head"].start) == ("wait", T0 + H), policy
        assert got["overruns"].action == "wait" and got["overruns"].start >= T0 + 2 * H, (policy, got["overruns"])
        got = by_job(plan(nodes, busy_, [head, fits], T0, policy))
        assert (got["fits"].action, got["fits"].devices, got["fits"].end) == ("start", (2, 3), T0 + 30 * MIN), policy
        assert (got["head"].action, got["head"].start) == ("wait", T0 + H), policy


def test_the_start_and_the_return_of_the_output_count_in_occupancy():
    nodes = [node("n1", gpus=4)]
    busy_ = [running("a", "n1", (0, 1), until_h=1)]
    head = job("head", 4, H, 2 * H, ago_s=H)
    quick = job("quick", 2, 50 * MIN, 50 * MIN, start_s=2 * MIN, output_s=5 * MIN)  # 57 min in all: fits
    slow = job("slow", 2, 50 * MIN, 50 * MIN, start_s=2 * MIN, output_s=15 * MIN)  # 67 min: would delay head
    got = by_job(plan(nodes, busy_, [head, quick], T0, "easy"))
    assert (got["quick"].action, got["quick"].end) == ("start", T0 + 57 * MIN)
    got = by_job(plan(nodes, busy_, [head, slow], T0, "easy"))
    assert got["slow"].action == "wait" and got["head"].start == T0 + H


def test_a_deadline_is_judged_on_the_end_of_the_work_not_the_return():
    # the return reserve (return_s) already keeps the output's return before the deadline
    due = job("due", 1, 50 * MIN, 50 * MIN, deadline=T0 + H, return_s=5 * MIN, start_s=MIN, output_s=4 * MIN)
    (p,) = plan([node("n1", gpus=1)], [], [due], T0)
    assert p.action == "start" and p.end == T0 + 55 * MIN
    assert p.reason.endswith("ends 00:51 UTC, before its deadline 01:00 UTC"), p.reason
    late = job("late", 1, 55 * MIN, 55 * MIN, deadline=T0 + H, return_s=5 * MIN, start_s=MIN)
    (p,) = plan([node("n1", gpus=1)], [], [late], T0)
    assert (p.action, p.reason) == ("refuse", "deadline 01:00 UTC cannot be met even on an empty pool: started when "
                                    "submitted (00:00 UTC) it would end 00:56 UTC (run time 55m: duration + start 1m, "
                                    "and 300 s to return its output before the deadline)")


# -- work conservation ------------------------------------------------------------------------------

def test_a_deferred_deadline_job_starts_now_when_nothing_else_can_use_the_node():
    # one 4-GPU node, five 4-GPU jobs, three with deadlines: the deadline job that needs the time is placed
    # "no earlier than needed", but no other job fits the time before that, so it starts now
    nodes = [node("n1", gpus=4)]
    jobs = [job("x1", 4, H, H, ago_s=3 * H), job("x2", 4, H, H, ago_s=3 * H),
            job("d1", 4, 30 * MIN, 30 * MIN, deadline=T0 + 1.5 * H),
            job("d2", 4, 30 * MIN, 30 * MIN, deadline=T0 + 6 * H), job("d3", 4, 30 * MIN, 30 * MIN, deadline=T0 + 8 * H)]
    got = by_job(plan(nodes, [], jobs, T0))
    started = [p.job for p in got.values() if p.action == "start"]
    assert started == ["d1"], got
    assert got["d1"].end == T0 + 30 * MIN
    assert all(p.start >= T0 + 30 * MIN for p in got.values() if p.job != "d1")


def _fits_now_around_the_rest(nodes, running_, queued_, placements, target) -> bool:
    """Does ``target`` (a waiting job) fit now, around every other placement that holds capacity, on its
    estimate when no job ranked ahead of it waits, else on its limit (the planner's own rule)?"""
    by_id = {j.id: j for j in queued_}
    cap = Capacity(nodes, running_, T0)
    where = {n.name: i for i, n in enumerate(nodes)}
    waits, ahead_waits = False, None  # waits: a job ranked so far waits on a reservation
    for p in placements:
        if p.action == "refuse":
            continue
        j = by_id[p.job]
        if p.job == target.id:
            ahead_waits = waits
        elif p.action == "start" or p.reserved:  # what it holds: its limit when it started behind a waiting job
            mask = sum(1 << d for d in p.devices)
            size = j.hard_occupancy_s if waits and p.action == "start" else j.occupancy_s
            cap.reserve(where[p.node], p.start, p.start + size, mask, j.cpus, j.memory, p.job)
        waits = waits or (p.action == "wait" and p.reserved)
    size = target.hard_occupancy_s if ahead_waits else target.occupancy_s
    eligible = [(target.gpu_type is None or (n.gpu_type or "").lower() == target.gpu_type.lower())
                and n.gpus >= target.gpus and n.cpus >= target.cpus and n.memory >= target.memory for n in nodes]
    return cap.earliest((target.gpus, target.cpus, target.memory, size), eligible, T0, T0) is not None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), policy=st.sampled_from([p for p in POLICIES if p != "fcfs"]))
def test_no_plan_leaves_room_idle_that_a_waiting_job_could_use_now(data, policy):
    """Work conservation: no waiting job fits now around everything else the plan holds (FCFS is left
    out: it never lets a later job overtake, by definition)."""
    nodes = data.draw(pools())
    running_, queued_ = data.draw(busy(nodes)), data.draw(queues())
    placements = plan(nodes, running_, queued_, T0, policy)
    for p in placements:
        if p.action == "wait":
            target = next(j for j in queued_ if j.id == p.job)
            assert not _fits_now_around_the_rest(nodes, running_, queued_, placements, target), (p, placements)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), policy=st.sampled_from(POLICIES))
def test_backfilled_jobs_run_to_their_limit_never_delay_the_first_reservation(data, policy):
    """EASY's guarantee with jobs that overrun their estimate: plan, then plan again at the same moment
    with the started jobs running (those ranked behind the first reservation until their hard stop, the
    rest until their estimate): the first reserved job's start is no later."""
    nodes = data.draw(pools())
    running_, queued_ = data.draw(busy(nodes)), data.draw(queues(deadlines=False))
    placements = plan(nodes, running_, queued_, T0, policy)
    ranked = [p for p in placements if p.action != "refuse"]
    first = next((k for k, p in enumerate(ranked) if p.action == "wait" and p.reserved), None)
    if first is None:
        return
    by_id = {j.id: j for j in queued_}
    now_running = list(running_)
    for k, p in enumerate(ranked):
        if p.action == "start":
            j = by_id[p.job]
            end = T0 + (j.hard_occupancy_s if k > first else j.occupancy_s)
            now_running.append(RunningJob(p.job, p.node, p.devices, j.cpus, j.memory, T0, end))
    left = [by_id[p.job] for p in ranked if p.action == "wait"]
    again = by_job(plan(nodes, now_running, left, T0, policy))
    head = ranked[first]
    assert again[head.job].start <= head.start, (head, again[head.job])


# -- order --------------------------------------------------------------------------------------------

def test_a_shorter_job_is_ahead_at_equal_wait_for_every_estimate():
    assert expansion_factor(100, 2) == expansion_factor(100, 9) == 11.0
    assert expansion_factor(100, 10) > expansion_factor(100, 11) > expansion_factor(100, 3600)
    assert expansion_factor(0, 5) == expansion_factor(0, 500) == 1.0
    one = [node("n1", gpus=1)]
    nine, two = job("nine", 1, 9, 9, ago_s=100), job("two", 1, 2, 2, ago_s=100)
    got = plan(one, [], [nine, two], T0)
    assert [(p.job, p.action) for p in got] == [("two", "start"), ("nine", "wait")]


def test_trace_job_numbers_submitted_together_keep_their_numeric_order():
    one = [Node("c1", 0, 1, GIB)]
    jobs = [SimJob(QueuedJob(id=str(n), name=str(n), gpus=0, cpus=1, memory=0, submitted=T0, runtime_s=5,
                             limit_s=5), 5) for n in (10, 9, 100, 11)]
    for policy in ("fcfs", "easy", "e31"):
        result = simulate(one, jobs, policy)
        assert sorted(result.starts, key=result.starts.get) == ["9", "10", "11", "100"], policy
        assert result.avg_wait_s == (0 + 5 + 10 + 15) / 4, policy
    got = plan(one, [], [j.job for j in jobs], T0, "fcfs")
    assert [p.job for p in got] == ["9", "10", "11", "100"]


def test_utilisation_is_of_the_resource_the_jobs_use_and_infeasible_jobs_are_not_feasible():
    pool = [Node("g1", 4, 4, GIB)]
    cpu_jobs = [SimJob(QueuedJob(id=str(n), name=str(n), gpus=0, cpus=2, memory=0, submitted=T0, runtime_s=100,
                                 limit_s=100, deadline=T0 + 1000), 100) for n in (1, 2)]
    too_big = SimJob(QueuedJob(id="3", name="3", gpus=0, cpus=8, memory=0, submitted=T0, runtime_s=100,
                               limit_s=100, deadline=T0 + 1000), 100)
    result = simulate(pool, [*cpu_jobs, too_big], "easy")
    assert result.utilization == 1.0  # 2 x 2 CPUs for 100 s of 4 CPUs x 100 s
    assert (result.refused, result.deadlines_total, result.deadlines_feasible, result.deadlines_met) == (1, 3, 2, 2)


# -- e31 plan --now -----------------------------------------------------------------------------------

SPEC = """\
spec_version: 1
name: nightly
work: {{kind: training, command: [python, -c, "pass"]}}
request: {{gpus: 0, cpus: 1, duration: 10m, deadline: "{deadline}"}}
output: {{kind: results, url: out/, files: [a.txt]}}
"""


def test_plan_now_judges_a_deadline_as_of_now(e31, tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text("pool_version: 1\nname: p\nnodes:\n  - {name: c1, cpus: 2, memory: 1GiB}\n")
    past = tmp_path / "past.yaml"  # a deadline the real clock has passed, planned as of a day before it
    past.write_text(SPEC.format(deadline="2026-01-02T06:00:00+00:00"))
    out = e31("plan", str(past), "--pool", str(pool), "--now", "2026-01-01T06:00:00Z")
    assert out.returncode == 0, out.stderr
    assert "nightly  start" in out.stdout and "before its deadline 2026-01-02 06:00 UTC" in out.stdout, out.stdout
    future = tmp_path / "future.yaml"  # a deadline after the real clock, before --now
    future.write_text(SPEC.format(deadline="2099-01-01T00:00:00+00:00"))
    out = e31("plan", str(future), "--pool", str(pool), "--now", "2099-06-01T00:00:00Z")
    assert out.returncode == 2, out.stdout
    assert ("request.deadline: must be after the planning time 2099-06-01T00:00:00+00:00 (--now); this deadline has "
            "passed by then (got '2099-01-01T00:00:00+00:00')") in out.stderr, out.stderr


def test_plan_now_outside_the_years_a_plan_can_reach_is_refused_in_one_line(e31, tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text("pool_version: 1\nname: p\nnodes:\n  - {name: c1, cpus: 2, memory: 1GiB}\n")
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC.format(deadline="2099-01-01T00:00:00+00:00").replace(', deadline: "2099-01-01T00:00:00+00:00"', ""))
    for when in ("9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00+14:00"):
        out = e31("plan", str(spec), "--pool", str(pool), "--now", when)
        assert out.returncode == 2, out.stdout
        assert out.stderr.strip().endswith(
            f"argument --now: must be between 1971-01-01 and 9000-01-01 (got '{when}')"), out.stderr
