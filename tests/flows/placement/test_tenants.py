"""Tenants in the pure planner: quota first, fair share by weight and decayed usage, borrow limits,
reclaim of borrowed capacity; properties over random pools, queues and tenants."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from e31.flows.placement import POLICIES, plan
from e31.flows.placement.tenants import (BorrowLimits, Tenancy, Tenant, borrowing, decayed_service, dominant_share,
                                         fair_order)
from tests.flows.placement.helpers import GIB, H, T0, node, queued, running
from tests.flows.placement.test_properties import FEW, busy, check_never_oversubscribed, pools, queues

DAY = 86400.0


def _tenancy(*tenants: Tenant, gpus: int = 8, half_life_s: float = 7 * DAY) -> Tenancy:
    return Tenancy({t.name: t for t in tenants}, (float(gpus), 64.0, 512.0 * GIB), half_life_s)


def _of(job, tenant: str):
    return replace(job, tenant=tenant)


def test_usage_decays_by_half_each_half_life():
    # 2 GPUs for one hour, ended one half-life ago: half of what it would count just after its end
    fresh = decayed_service((2.0, 0.0, 0.0), T0 - H, T0, T0, 7 * DAY)
    old = decayed_service((2.0, 0.0, 0.0), T0 - 7 * DAY - H, T0 - 7 * DAY, T0, 7 * DAY)
    assert math.isclose(old[0], fresh[0] / 2, rel_tol=1e-9)
    assert round(fresh[0], 1) == 7185.2  # 7,200 GPU-seconds, the hour's start already decayed by 2^(-1/168)
    assert decayed_service((2.0, 0.0, 0.0), T0, T0 + H, T0, 7 * DAY) == (0.0, 0.0, 0.0)  # not yet used
    assert dominant_share((4.0, 16.0, 0.0), (8.0, 64.0, 0.0)) == 0.5


def test_jobs_within_their_tenant_s_quota_come_before_any_borrowing():
    tenancy = _tenancy(Tenant("vision", quota=(4.0, 32.0, 256.0 * GIB)), Tenant("nlp", quota=(4.0, 32.0, 256.0 * GIB)))
    # vision submitted first and asks for 8 GPUs in two jobs; nlp's one job comes later
    jobs = [_of(queued("v1", 4, 1, ago_h=3), "vision"), _of(queued("v2", 4, 1, ago_h=3), "vision"),
            _of(queued("n1", 4, 1, ago_h=1), "nlp")]
    order, nominal = fair_order(jobs, [], tenancy)
    assert [jobs[k].id for k in order] == ["v1", "n1", "v2"] and nominal == {"v1", "n1"}
    got = {p.job: p for p in plan([node("a", gpus=8)], [], jobs, T0, tenancy=tenancy)}
    assert (got["v1"].action, got["n1"].action, got["v2"].action) == ("start", "start", "wait")
    assert got["v2"].reason == ("waiting for 4 GPUs on one node (0 free on a); earliest start 01:00 UTC on a, after job "
                                "v1 ends; tenant vision is at its quota (4 of 4 GPUs held or planned): "
                                "its jobs beyond it wait behind jobs within their tenants' quotas")
    # without tenants, arrival order: vision's two jobs take the node
    plain = {p.job: p for p in plan([node("a", gpus=8)], [], jobs, T0, "easy")}
    assert (plain["v1"].action, plain["v2"].action, plain["n1"].action) == ("start", "start", "wait")


def test_fair_share_follows_weights_and_decayed_usage():
    a, b = Tenant("a", weight=2.0), Tenant("b", weight=1.0)
    jobs = [_of(queued(f"a{k}", 1, 1, ago_h=2), "a") for k in range(6)] + \
           [_of(queued(f"b{k}", 1, 1, ago_h=1), "b") for k in range(6)]
    order, _ = fair_order(jobs, [], _tenancy(a, b))
    first_six = [jobs[k].tenant for k in order[:6]]
    assert first_six.count("a") == 4 and first_six.count("b") == 2  # 2:1 by weight
    # tenant a used the whole pool for the last day: b goes first until its allocation catches up
    used = decayed_service((8.0, 0.0, 0.0), T0 - DAY, T0, T0, 7 * DAY)
    order, _ = fair_order(jobs, [], _tenancy(replace(a, weight=1.0, usage=used), b))
    assert [jobs[k].tenant for k in order[:3]] == ["b", "b", "b"]


def test_a_tenant_at_its_borrow_limit_waits_for_its_own_jobs_to_end_and_a_job_over_it_is_refused():
    nlp = Tenant("nlp", quota=(2.0, 0.0, 0.0), borrow_limit=(2.0, math.inf, math.inf))  # at most 4 GPUs
    tenancy = _tenancy(nlp, Tenant("vision", quota=(6.0, 0.0, 0.0)))
    held = [_of(running("r1", "a", (0, 1, 2), until_h=2), "nlp")]
    jobs = [_of(queued("n2", 2, 1), "nlp"), _of(queued("n3", 1, 1), "nlp"), _of(queued("huge", 5, 1), "nlp")]
    got = {p.job: p for p in plan([node("a", gpus=8)], held, jobs, T0, tenancy=tenancy)}
    assert got["n3"].action == "start"  # 3 + 1 = 4: within the limit
    assert (got["n2"].action, got["n2"].start) == ("wait", T0 + 2 * H)  # 4 + 2 > 4: after r1 ends
    assert got["n2"].reason == ("waiting: tenant nlp holds 3 GPUs, and 2 GPUs more would pass its quota and "
                                "borrow_limit (4 GPUs); it starts as the tenant's running jobs end; planned to start "
                                "02:00 UTC on a")
    assert got["huge"].action == "refuse"
    assert got["huge"].reason == ("asks for more than tenant nlp may hold (its quota and borrow_limit: 4 GPUs); "
                                  "ask for less, or raise the tenant's borrow_limit in the pool file")
    limits = BorrowLimits(held, tenancy, T0)
    assert limits.allows(jobs[1]) and not limits.allows(jobs[0]) and limits.after(jobs[0]) == T0 + 2 * H


def test_a_job_held_by_its_tenant_s_borrow_limit_waits_for_the_jobs_the_same_plan_starts_and_reserves_no_more():
    """x1 starts now and takes tenant x to 3 of its 4 GPUs (quota 2 + borrow_limit 2): x2 (3 GPUs) fits
    only once x1 ends, an hour on, not a second from now (the planned start then held 5 GPUs that y1
    could use now: y1 waited behind a reservation that could never start)."""
    x = Tenant("x", quota=(2.0, 0.0, 0.0), borrow_limit=(2.0, math.inf, math.inf))
    y = Tenant("y", usage=(1e6, 0.0, 0.0))  # far more past usage: x's jobs come first
    jobs = [_of(queued("x1", 3, 1), "x"), _of(queued("x2", 3, 1), "x"), _of(queued("y1", 5, 1), "y")]
    got = {p.job: p for p in plan([node("a", gpus=8)], [], jobs, T0, tenancy=_tenancy(x, y))}
    assert (got["x1"].action, got["y1"].action) == ("start", "start")
    assert (got["x2"].action, got["x2"].start) == ("wait", T0 + H)
    assert got["x2"].reason.startswith("waiting: tenant x holds 3 GPUs, and 3 GPUs more would pass its quota and "
                                       "borrow_limit (4 GPUs); it starts as the tenant's running jobs end")


def test_the_latest_started_jobs_beyond_a_quota_are_the_borrowing_ones():
    tenancy = _tenancy(Tenant("vision", quota=(4.0, 64.0, 512.0 * GIB)))
    jobs = [replace(_of(running(f"r{k}", "a", (2 * k, 2 * k + 1), until_h=5), "vision"), start=T0 - (5 - k) * H)
            for k in range(3)]
    assert borrowing(jobs, tenancy) == {"r2"}
    assert borrowing([_of(running("d", "a", (0,), until_h=1), "default")], tenancy) == {"d"}  # no quota


@FEW
@given(data=st.data(), policy=st.sampled_from(POLICIES))
def test_one_tenant_plans_as_no_tenants(data, policy):
    nodes = data.draw(pools())
    running_, queued_ = data.draw(busy(nodes)), data.draw(queues())
    alone = Tenancy({"default": Tenant("default")}, (8.0, 64.0, 64.0 * GIB))
    assert plan(nodes, running_, queued_, T0, policy, tenancy=alone) == plan(nodes, running_, queued_, T0, policy)


@st.composite
def tenancies(draw, nodes):
    names = ["a", "b", "c"][:draw(st.integers(2, 3))]
    total = (float(sum(n.gpus for n in nodes)), float(sum(n.cpus for n in nodes)), float(sum(n.memory for n in nodes)))
    tenants = []
    for name in names:
        quota = (float(draw(st.integers(0, 4))), float(draw(st.integers(0, 8))), 0.0)
        limit = draw(st.one_of(st.none(), st.tuples(st.integers(0, 6), st.sampled_from([0, 4, 16, math.inf])).map(
            lambda t: (float(t[0]), float(t[1]), math.inf))))
        tenants.append(Tenant(name, quota, draw(st.sampled_from([0.5, 1.0, 3.0])), limit))
    return Tenancy({t.name: t for t in tenants}, total), names


@FEW
@given(data=st.data(), policy=st.sampled_from([p for p in POLICIES if p != "fcfs"]))
def test_no_plan_oversubscribes_or_takes_a_tenant_past_its_borrow_limit(data, policy):
    nodes = data.draw(pools())
    tenancy, names = data.draw(tenancies(nodes))
    running_ = [replace(r, tenant=data.draw(st.sampled_from(names))) for r in data.draw(busy(nodes))]
    queued_ = [replace(q, tenant=data.draw(st.sampled_from(names))) for q in data.draw(queues())]
    placements = plan(nodes, running_, queued_, T0, policy, tenancy=tenancy)
    check_never_oversubscribed(nodes, running_, queued_, placements)
    by_id = {q.id: q for q in queued_}
    for name in names:
        t = tenancy.of(name)
        if t.borrow_limit is None:
            continue
        bound = [q + b for q, b in zip(t.quota, t.borrow_limit)]
        now = [sum(len(r.devices) for r in running_ if r.tenant == name), sum(r.cpus for r in running_ if r.tenant == name)]
        started = [by_id[p.job] for p in placements if p.action == "start" and by_id[p.job].tenant == name]
        if not started:
            continue
        gpus, cpus = now[0] + sum(j.gpus for j in started), now[1] + sum(j.cpus for j in started)
        assert gpus <= bound[0] and cpus <= bound[1], (name, t, started)


@FEW
@given(data=st.data())
def test_every_nominal_job_is_ordered_before_every_borrowing_one_and_each_tenant_keeps_its_order(data):
    nodes = data.draw(pools())
    tenancy, names = data.draw(tenancies(nodes))
    running_ = [replace(r, tenant=data.draw(st.sampled_from(names))) for r in data.draw(busy(nodes))]
    queued_ = [replace(q, tenant=data.draw(st.sampled_from(names))) for q in data.draw(queues())]
    order, nominal = fair_order(queued_, running_, tenancy)
    assert sorted(order) == list(range(len(queued_)))
    flags = [queued_[k].id in nominal for k in order]
    assert flags == sorted(flags, reverse=True)  # every True before every False
    for name in names:
        mine = [k for k in order if queued_[k].tenant == name]
        assert mine == sorted(mine)


@FEW
@given(data=st.data())
def test_the_fair_order_is_the_progressive_filling_of_its_definition(data):
    """fair_order (a heap of each tenant's next job) against the rule written out plainly: each next job
    from the tenant with the lowest (decayed history + allocation) / weight, ties to the job first in the
    policy's order, nominal jobs before borrowing ones."""
    from e31.flows.placement import tenants as t

    nodes = data.draw(pools())
    tenancy, names = data.draw(tenancies(nodes))
    tenancy = replace(tenancy, tenants={n: replace(v, usage=(data.draw(st.floats(0, 1e6)), 0.0, 0.0))
                                        for n, v in tenancy.tenants.items()})
    running_ = [replace(r, tenant=data.draw(st.sampled_from(names))) for r in data.draw(busy(nodes))]
    queued_ = [replace(q, tenant=data.draw(st.sampled_from(names))) for q in data.draw(queues())]
    order, nominal = fair_order(queued_, running_, tenancy)
    total = t.sum_of(tenancy.of(n).usage for n in {*tenancy.tenants, *(q.tenant for q in queued_)})
    allocation, expected = t.held_by(running_), []
    for borrowing_class in (False, True):
        left = [k for k in range(len(queued_)) if (queued_[k].id not in nominal) == borrowing_class]
        while left:
            heads = {}
            for k in left:
                heads.setdefault(queued_[k].tenant, k)

            def share(name):
                return (t._history(tenancy.of(name), total) + t.dominant_share(
                    allocation.get(name, (0.0, 0.0, 0.0)), tenancy.capacity)) / tenancy.of(name).weight

            k = min(heads.values(), key=lambda k: (share(queued_[k].tenant), k))
            expected.append(k)
            left.remove(k)
            name = queued_[k].tenant
            allocation[name] = t._add(allocation.get(name, (0.0, 0.0, 0.0)), t._request(queued_[k]))
    assert order == expected


def test_a_job_within_its_quota_takes_back_what_another_tenant_borrowed():
    """vision (quota 4 GPUs) waits while nlp (quota 4) holds all 8: nlp's latest-started preemptible job
    beyond its quota is the victim, once it has run the pool's min_run; nlp's jobs within its quota and
    non-preemptible ones never are."""
    from e31.flows.placement.preemption import PreemptionRules, deferred_preemptions, plan_preemptions

    tenancy = _tenancy(Tenant("vision", quota=(4.0, 32.0, 256.0 * GIB)), Tenant("nlp", quota=(4.0, 32.0, 256.0 * GIB)))
    nodes = [node("a", gpus=8)]

    def nlp(job_id, devices, started_h, preemptible=True):
        r = _of(running(job_id, "a", devices, until_h=10), "nlp")
        return replace(r, start=T0 - started_h * H, preemptible=preemptible)

    held = [nlp("within", (0, 1, 2, 3), 5), nlp("lent", (4, 5, 6, 7), 1)]
    waiting = [_of(queued("v1", 4, 1), "vision")]
    placements = plan(nodes, held, waiting, T0, tenancy=tenancy)
    assert placements[0].action == "wait"
    rules = PreemptionRules(min_run_s=600.0)
    got = plan_preemptions(nodes, held, waiting, placements, T0, rules, tenancy)
    assert [(p.job, p.preemption.victims) for p in got] == [("v1", ("lent",))]
    assert plan_preemptions(nodes, held, waiting, placements, T0, rules) == []  # without tenants: nothing to reclaim
    young = [held[0], replace(held[1], start=T0 - 60)]  # the borrowed job has run a minute: under min_run
    placed = plan(nodes, young, waiting, T0, tenancy=tenancy)
    assert plan_preemptions(nodes, young, waiting, placed, T0, rules, tenancy) == []
    later = deferred_preemptions(nodes, young, waiting, placed, [], T0, rules, tenancy)
    assert {k: (at, p.victims) for k, (at, p) in later.items()} == {"v1": (T0 + 540, ("lent",))}  # its min_run
    assert deferred_preemptions(nodes, young, waiting, placed, [], T0, rules) == {}  # no tenants: no reclaim
    fixed = [held[0], replace(held[1], preemptible=False)]
    assert plan_preemptions(nodes, fixed, waiting, plan(nodes, fixed, waiting, T0, tenancy=tenancy), T0, rules,
                            tenancy) == []
    # a vision job beyond vision's quota reclaims nothing
    over = [_of(queued("v9", 8, 1), "vision")]
    assert plan_preemptions(nodes, held, over, plan(nodes, held, over, T0, tenancy=tenancy), T0, rules, tenancy) == []


def test_a_replay_with_tenants_serves_the_tenant_that_asked_for_little_first_and_counts_each_tenant():
    """Tenant a submits 40 one-hour jobs of 4 GPUs at once on one 8-GPU node; tenant b submits 4 such jobs
    a minute later.  Without tenants b waits behind a's whole sweep; with equal shares (quota 4 GPUs
    each) b's jobs start as a's first ones end, and the result counts each tenant's jobs, waits and
    GPU-hours."""
    from e31.flows.placement.simulate import SimJob, simulate

    nodes = [node("n", gpus=8)]
    jobs = [SimJob(_of(queued(f"a{k:02d}", 4, 1, ago_h=0), "a"), H) for k in range(40)] + \
           [SimJob(replace(_of(queued(f"b{k}", 4, 1), "b"), submitted=T0 + 60), H) for k in range(4)]
    plain = simulate(nodes, jobs, "e31")
    assert plain.tenants is None and "tenants" not in plain.summary()
    waits_b = [plain.starts[f"b{k}"] - (T0 + 60) for k in range(4)]
    assert min(waits_b) >= 18 * H  # behind a's sweep
    half = (4.0, 32.0, 256.0 * GIB)
    shared = simulate(nodes, jobs, "e31", tenancy=_tenancy(Tenant("a", quota=half), Tenant("b", quota=half)))
    waits_b = sorted(shared.starts[f"b{k}"] - (T0 + 60) for k in range(4))
    assert waits_b == [H - 60, 2 * H - 60, 3 * H - 60, 4 * H - 60]  # one b job each time one of a's ends
    assert shared.tenants["b"] == {"jobs": 4, "mean_wait_s": 2.5 * H - 60, "gpu_hours": 16.0}
    assert shared.tenants["a"]["jobs"] == 40 and shared.tenants["a"]["gpu_hours"] == 160.0
    assert shared.summary()["tenants"]["b"]["jobs"] == 4


def test_e31_simulate_maps_trace_users_to_tenants(tmp_path, e31):
    """``--fair-share`` without tenants: each SWF user id is a tenant ``u<id>``; a pool's tenants take
    the ids their members list, the rest fall into ``default``."""
    import json
    from pathlib import Path

    data = Path(__file__).parent / "data"
    trace, plain = str(data / "small.swf"), str(data / "one-node.yaml")
    done = e31("simulate", trace, "--pool", plain, "--fair-share", "--json")
    assert done.returncode == 0, done.stderr
    tenants = json.loads(done.stdout)["tenants"]
    assert {k: v["jobs"] for k, v in tenants.items()} == {"u1": 4, "u2": 3, "u3": 4}
    pool = tmp_path / "pool.yaml"
    pool.write_text("pool_version: 1\nname: small\nnodes:\n  - {name: c1, cpus: 4, memory: 1GiB}\ntenants:\n"
                    "  - {name: ops, quota: {cpus: 2}, members: [u1]}\n  - {name: lab, quota: {cpus: 2}, members: [u2]}\n")
    done = e31("simulate", trace, "--pool", str(pool), "--json")
    assert done.returncode == 0, done.stderr
    tenants = json.loads(done.stdout)["tenants"]
    assert {k: v["jobs"] for k, v in tenants.items()} == {"default": 4, "lab": 3, "ops": 4}
    assert "tenants" not in json.loads(e31("simulate", trace, "--pool", plain, "--json").stdout)


def test_a_job_larger_than_its_tenant_s_quota_alone_is_told_so_not_that_the_quota_is_full():
    from e31.flows.placement.tenants import amount_words, beyond_quota

    tenancy = _tenancy(Tenant("nlp", quota=(1.0, math.inf, math.inf)))
    big = _of(queued("big", 2, 1), "nlp")
    assert beyond_quota(tenancy, [], [big], set()) == {"big": (
        "it asks for more than tenant nlp's quota (1 GPU) alone: it runs in capacity no tenant within its "
        "quota needs, ordered by fair share")}
    assert (amount_words((1.0, 1.0, 0.0)), amount_words((2.0, 16.0, 4 * GIB))) == ("1 GPU, 1 CPU", "2 GPUs, 16 CPUs, 4 GiB")


def test_e31_pool_lists_the_tenants_and_e31_plan_applies_them(tmp_path, e31):
    """e31 pool printed no tenant, and e31 plan said 'start' for a job e31 submit refuses: the pool's
    quotas and borrow limits apply to the planned jobs' tenant (--tenant, else the user's, else default)."""
    pool = tmp_path / "pool.yaml"
    pool.write_text("pool_version: 1\nname: gp\nnodes: [{name: a, gpus: 4, cpus: 16, memory: 64GiB}]\ntenants:\n"
                    "  - {name: default, quota: {gpus: 1}, borrow_limit: {gpus: 0}}\n"
                    "  - {name: vision, quota: {gpus: 2, memory: 32GiB}, weight: 2, members: [alice, bob]}\n"
                    "fair_share: {half_life: 3d}\n")
    spec = tmp_path / "g4.yaml"
    spec.write_text("name: g4\nwork: {kind: simulation, command: [sleep, '1']}\nrequest: {gpus: 4, cpus: 1, duration: 1h}\n"
                    f"output: {{kind: results, url: {tmp_path / 'out'}, files: [r.json]}}\n")
    listed = e31("pool", str(pool))
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[-4:] == [
        "tenants (fair share half-life 3d; a job of anyone else is tenant default's):",
        "TENANT   QUOTA          WEIGHT  BORROW LIMIT  MEMBERS",
        "default  1 GPU          1       0 GPUs        -",
        "vision   2 GPUs, 32GiB  2       any           alice, bob"]
    now = "2026-01-01T00:00:00Z"
    mine = e31("plan", str(spec), "--pool", str(pool), "--now", now, env={"USER": "carol", "LOGNAME": "carol"})
    assert mine.returncode == 1 and mine.stdout.splitlines()[0].endswith("(policy e31; tenant default)")
    assert mine.stdout.splitlines()[2].split(None, 6)[6] == (
        "asks for more than tenant default may hold (its quota and borrow_limit: 1 GPU); ask for less, or raise the "
        "tenant's borrow_limit in the pool file")
    alice = e31("plan", str(spec), "--pool", str(pool), "--now", now, env={"USER": "alice", "LOGNAME": "alice"})
    named = e31("plan", str(spec), "--pool", str(pool), "--now", now, "--tenant", "vision")
    for done in (alice, named):
        assert done.returncode == 0 and done.stdout.splitlines()[0].endswith("(policy e31; tenant vision)")
        assert done.stdout.splitlines()[2].split()[:3] == ["g4", "start", "a"]
    unknown = e31("plan", str(spec), "--pool", str(pool), "--tenant", "nosuch")
    assert (unknown.returncode, unknown.stderr) == (2, "e31: --tenant: pool gp has no tenant 'nosuch'; name one of "
                                                       "default, vision, or add it to the pool file's tenants\n")


def test_no_preemption_takes_a_tenant_past_its_borrow_limit():
    """The plan held tenant a's deadline job back (a holds its quota 2 + borrow_limit 0), but the preemption
    planned after it gave that job a victim of tenant b, and a then held 4 GPUs (found by an attack)."""
    from e31.flows.placement import Node, QueuedJob, RunningJob
    from e31.flows.placement.preemption import PreemptionRules, plan_preemptions

    inf = math.inf
    nodes = [Node("n1", 4, 16, 64 * GIB), Node("n2", 4, 16, 64 * GIB)]
    tenancy = Tenancy({"a": Tenant("a", (2.0, inf, inf), 1.0, (0.0, inf, inf)), "b": Tenant("b", (6.0, inf, inf))},
                      (8.0, 32.0, 128 * GIB))
    held = [RunningJob("ra", "n1", (0, 1), 1, GIB, T0 - 2 * H, T0 + 5 * H, tenant="a"),
            RunningJob("rb", "n1", (2, 3), 1, GIB, T0 - 2 * H, T0 + 5 * H, preemptible=True, checkpoint_at=T0 - 10,
                       tenant="b"),
            RunningJob("rb2", "n2", (0, 1, 2, 3), 1, GIB, T0 - 2 * H, T0 + 5 * H, preemptible=True,
                       checkpoint_at=T0 - 10, tenant="b")]
    urgent = [QueuedJob("d", "d", 2, 1, GIB, T0, H, H, deadline=T0 + 2 * H, runtime_source="duration", tenant="a")]
    placements = plan(nodes, held, urgent, T0, tenancy=tenancy)
    assert placements[0].action == "wait"
    rules = PreemptionRules(min_run_s=0.0, max_per_day=None)
    assert plan_preemptions(nodes, held, urgent, placements, T0, rules, tenancy) == []
    # with room in its bound (borrow_limit 2), the same job preempts a borrower of b's for its deadline
    roomy = Tenancy({**tenancy.tenants, "a": Tenant("a", (2.0, inf, inf), 1.0, (2.0, inf, inf))}, tenancy.capacity)
    got = plan_preemptions(nodes, held, urgent, plan(nodes, held, urgent, T0, tenancy=roomy), T0, rules, roomy)
    assert [(p.job, p.preemption.victims) for p in got] == [("d", ("rb",))]


def test_jobs_held_by_their_tenant_s_bound_take_turns_and_leave_the_room_between_to_others():
    """Three 2-GPU jobs of tenant a (bound 2 GPUs, held until a0's run ends in an hour) were all planned at
    that hour, 6 GPUs against a bound of 2, and c1 waited two hours beside 6 idle GPUs (found by an attack)."""
    inf = math.inf
    tenancy = _tenancy(Tenant("a", (2.0, inf, inf), 1.0, (0.0, inf, inf)), Tenant("c", usage=(1e6, 0.0, 0.0)))
    held = [_of(running("ra", "n1", (0, 1), until_h=1), "a")]
    jobs = [_of(queued(f"a{k}", 2, 1, ago_h=0.1), "a") for k in range(3)] + [_of(queued("c1", 4, 2), "c")]
    got = {p.job: p for p in plan([node("n1", gpus=8)], held, jobs, T0, tenancy=tenancy)}
    assert [(got[k].action, got[k].start) for k in ("a0", "a1", "a2")] == [
        ("wait", T0 + H), ("wait", T0 + 2 * H), ("wait", T0 + 3 * H)]
    assert (got["c1"].action, got["c1"].start) == ("start", T0)


def test_a_borrowing_job_s_reason_counts_its_tenant_s_borrowing_jobs_ahead_of_it():
    """C (2 GPUs) came after B (4 GPUs, borrowing): its reason said 'would pass its quota with this job
    (nothing held or planned)' while tenant a had 6 GPUs of a quota of 4 (found by an attack)."""
    tenancy = _tenancy(Tenant("a", quota=(4.0, math.inf, math.inf)), Tenant("b", quota=(2.0, math.inf, math.inf)),
                       gpus=6)
    jobs = [_of(queued("A", 2, 1 / 6, ago_h=0.3), "a"), _of(queued("B", 4, 1 / 3, ago_h=0.2), "a"),
            _of(queued("C", 2, 1 / 2, ago_h=0.1), "a")]
    got = {p.job: p for p in plan([node("g", gpus=6)], [], jobs, T0, tenancy=tenancy)}
    assert (got["A"].action, got["B"].action, got["C"].action) == ("start", "start", "wait")
    assert got["C"].reason.endswith("; tenant a is over its quota (6 of 4 GPUs held or planned): its jobs beyond it "
                                    "wait behind jobs within their tenants' quotas"), got["C"].reason
