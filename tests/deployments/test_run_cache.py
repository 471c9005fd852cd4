"""The scheduler's run cache against a real ``prefect server start``: after
one full read, each tick reads only what changed, and what it keeps matches
a full read after submissions, cancels, a worker's states, a flow retry and
a deletion (the changes a queued run can see from outside the scheduler)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

from tests.conftest import place_by_hand


def _spec(name: str, root: Path, duration: str = "5s"):
    from e31.specs import parse_spec

    return parse_spec({"name": name, "work": {"kind": "simulation", "command": [sys.executable, "-c", "pass"]},
                       "request": {"cpus": 1, "duration": duration, "limit": "1m" if duration == "5s" else "2h"},
                       "output": {"kind": "results", "url": str(root / "out" / name), "files": ["r.json"]}})


def _name(client, run_id: str) -> str:
    return client.read_flow_run(run_id).parameters["spec"]["name"]


class _Pool:
    """A one-node pool (n1) of its own on the session server; ``submit``
    creates a queued run of a small job named ``NAME-<tag>``."""

    def __init__(self, root: Path, **node: object):
        from e31.deployments.worker import E31Worker
        from e31.specs.pool import parse_pool

        self.spec = parse_pool({"pool_version": 1, "name": f"c{uuid.uuid4().hex[:8]}",
                                "nodes": [{"name": "n1", "gpus": 0, "cpus": 1, "memory": "1GiB", **node}]})
        self.template, self.tag, self.root = E31Worker.get_default_base_job_template(), uuid.uuid4().hex[:6], root

    def submit(self, client, name: str, duration: str = "5s") -> str:
        from e31.flows.deploy import parameters
        from e31.flows.queue import submit

        spec = _spec(f"{name}-{self.tag}", self.root, duration)
        return str(submit(client, self.spec, parameters(spec, None), ["e31"], self.template).id)


def test_the_cache_follows_every_change_and_matches_a_full_read(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Completed, Pending, Running, Scheduled

    from e31.deployments.scheduler import tick
    from e31.flows.queue import RunCache, read

    made = _Pool(tmp_path)
    pool = made.spec

    def new(name: str) -> str:
        return made.submit(client, name)

    with get_client(sync_client=True) as client:
        a, b, c = new("a"), new("b"), new("c")
        cache = RunCache(pool, full_every_s=3600)
        assert {str(r.id) for r in cache.read(client)} == {a, b, c}
        assert (cache.full_reads, cache.incremental_reads) == (1, 0)

        d = new("d")  # a submission
        client.set_flow_run_state(b, Cancelled(message="cancelled while queued"), force=True)  # from the UI
        client.set_flow_run_state(c, Pending(), force=True)  # a worker takes it...
        client.set_flow_run_state(c, Running(), force=True)  # ...and runs it
        cache.read(client)
        assert set(cache.runs) == {a, c, d} and cache.runs[c].state.type.value == "RUNNING"
        assert (cache.full_reads, cache.incremental_reads) == (1, 1)

        client.set_flow_run_state(c, Completed(), force=True)  # ends
        client.set_flow_run_state(a, Running(), force=True)
        cache.read(client)
        assert set(cache.runs) == {a, d}
        client.set_flow_run_state(a, Scheduled(name="AwaitingRetry"), force=True)  # a flow retry: running -> scheduled
        cache.read(client)
        assert set(cache.runs) == {a, d} and cache.runs[a].state.name == "AwaitingRetry"

        client.delete_flow_run(d)  # no filter shows a deletion: the write to it drops it
        e = new("e")
        cache.read(client)
        assert d in cache.runs
        result = tick(client, pool, cache=cache)
        assert result.counts["gone"] == 1 and d not in cache.runs and not result.full
        assert set(cache.runs) == {str(r) for r in read(client, pool).runs} == {a, e}
        kept = cache.runs[e]  # the tick's own write, kept as the server answered it
        assert kept.state.name == "Queued" and kept.state.message.startswith("Queued: waiting for 1 CPU on one node")
        server = client.read_flow_run(e)
        assert (kept.state.message, kept.next_scheduled_start_time) == (server.state.message,
                                                                       server.next_scheduled_start_time)
        assert cache.runs[a].state.name == "AwaitingRetry"  # not due before its expected start: left as it is


def test_a_background_full_read_replaces_the_kept_runs_and_loses_no_change(prefect_api, tmp_path):
    """The scheduler's periodic full read runs beside its ticks: no tick
    reads every run itself, and what changed while the full read ran (a
    submission, a cancel) is there after it replaced the kept runs."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    from e31.flows.queue import RunCache, read

    made = _Pool(tmp_path)
    pool = made.spec
    with get_client(sync_client=True) as client:
        def new(name: str) -> str:
            return made.submit(client, name)

        a, b = new("a"), new("b")
        cache = RunCache(pool, full_every_s=0.0)  # every read after the first starts (or takes) a full read
        try:
            cache.read(client)
            assert (cache.full_reads, cache.last_full) == (1, True)
            cache.read(client)  # starts one in the background
            c = new("c")
            client.set_flow_run_state(b, Cancelled(message="cancelled while queued"), force=True)
            deadline = time.monotonic() + 60
            while cache.full_reads < 3:  # two more: one may have begun before the changes
                cache.read(client)
                assert cache.last_full is False and time.monotonic() < deadline
                time.sleep(0.05)
            assert set(cache.runs) == {str(r) for r in read(client, pool).runs} == {a, c}
        finally:
            cache.close()


class _CancelAfter:
    """The session server's client, with one injected concurrent event: a
    cancel of run ``victim`` (forced, as from the UI or the API) that lands
    just after the scheduler's call ``after`` on that run (its check
    ``read_flow_run``, or a placement's ``update_flow_run``)."""

    def __init__(self, client, victim: str, after: str):
        self._client, self.victim, self.after, self.fired = client, victim, after, False

    def __getattr__(self, name):
        call = getattr(self._client, name)
        if name != self.after:
            return call

        def then_cancel(run_id, *args, **kwargs):
            from prefect.states import Cancelled

            answer = call(run_id, *args, **kwargs)
            if str(run_id) == self.victim and not self.fired:
                self.fired = True
                self._client.set_flow_run_state(run_id, Cancelled(message="cancelled by hand"), force=True)
            return answer
        return then_cancel


def test_a_cancel_landing_between_the_check_and_the_write_is_never_undone(prefect_api, tmp_path):
    """A queued job cancelled in the instant the scheduler places it must
    not be placed anyway (the write is forced) and run.  The write that
    overtook the cancel is undone: the run ends
    Cancelled, for a placement and for a waiting run's new reason alike."""
    from prefect.client.orchestration import get_client

    from e31.deployments.scheduler import tick
    from e31.flows.queue import RunCache, work_pool_name

    made, idle = _Pool(tmp_path), _Pool(tmp_path)  # idle: a pool whose node's worker never answered
    with get_client(sync_client=True) as client:
        runs = [made.submit(client, "first"), made.submit(client, "second"), idle.submit(client, "third")]
        caches = {made: RunCache(made.spec, full_every_s=3600), idle: RunCache(idle.spec, full_every_s=3600)}
        # a cancel after the placement's write, or after the check before it (the placement parameter is written
        # onto the cancelled run all the same, inert: Prefect refused a cancelled run's job_variables, which
        # placements were until December 2026, but not its parameters), or before a waiting run's new reason
        cases = [("update_flow_run", "start", "undone"), ("read_flow_run", "start", "undone"),
                 ("read_flow_run", "wait", "undone")]
        for victim, (after, action, count) in zip(runs, cases):
            # node n1's worker answers (the API call a worker makes), so a run may start; the waiting case's
            # pool never heard one, so "no live node" there holds whatever the clocks say
            pool = made if action == "start" else idle
            if action == "start":
                client.send_worker_heartbeat(work_pool_name(pool.spec), "n1")
            injected = _CancelAfter(client, victim, after)
            result = tick(injected, pool.spec, cache=caches[pool], lease_s=60.0)
            assert injected.fired and result.counts[count] == 1 and result.counts[action] == 0, str(result.counts)
            assert victim not in caches[pool].runs
            states = [(s.type.value, s.name) for s in client.read_flow_run_states(victim)]
            written = "Placed" if action == "start" else "Queued"  # the write overtook the cancel: set again
            assert states[-3:] == [("CANCELLED", "Cancelled"), ("SCHEDULED", written), ("CANCELLED", "Cancelled")]
            assert client.read_flow_run(victim).state.message == "cancelled by hand"


def test_a_background_full_read_keeps_what_the_scheduler_wrote_while_it_ran(prefect_api, tmp_path):
    """A full read that began before the scheduler placed a run must not
    replace the kept runs with its older view, or the placed run looks
    queued again and its node free (two jobs on one GPU)."""
    import threading

    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    from e31.flows.queue import RunCache

    made = _Pool(tmp_path)
    pool = made.spec
    read, go_on = threading.Event(), threading.Event()

    class Held(RunCache):  # the background full read is held after it has read, until the placement is written
        def _read_every(self, client):
            found = super()._read_every(client)
            if threading.current_thread() is not threading.main_thread():
                read.set()
                go_on.wait(30)
            return found

    with get_client(sync_client=True) as client:
        placed = made.submit(client, "p")
        cache = Held(pool, full_every_s=0.0)
        try:
            cache.read(client)
            cache.read(client)  # starts the full read in the background
            assert read.wait(30)
            cache.note_state(placed, client.set_flow_run_state(placed, Scheduled(name="Placed"), force=True))
            go_on.set()
            while cache.full_reads < 2:
                cache.read(client)
            assert cache.runs[placed].state.name == "Placed"
        finally:
            go_on.set()
            cache.close()


def test_a_tick_writes_waiting_reasons_within_its_time_budget_and_defers_the_rest(prefect_api, tmp_path):
    """``max_wait_s``: a tick rewrites waiting runs' reasons (soonest
    planned start first) only for as long as its budget allows; the next
    ticks write the rest.  A budget of 0 s writes one per tick.  (No worker
    answers for n1 here, so every run waits.)"""
    from prefect.client.orchestration import get_client

    from e31.deployments.scheduler import tick
    from e31.flows.queue import RunCache

    made = _Pool(tmp_path)
    with get_client(sync_client=True) as client:
        runs = [made.submit(client, name) for name in ("a", "b", "c", "d")]
        cache = RunCache(made.spec, full_every_s=3600)
        counts = [tick(client, made.spec, cache=cache, max_wait_s=0.0).counts for _ in range(5)]
        states = [client.read_flow_run(r).state for r in runs]
        names = {r: _name(client, r) for r in runs}
    pick = ("start", "wait", "deferred", "unchanged")
    assert [tuple(c[k] for k in pick) for c in counts] == [(0, 1, 3, 0), (0, 1, 2, 1), (0, 1, 1, 2), (0, 1, 0, 3),
                                                            (0, 0, 0, 4)]
    assert [s.name for s in states] == ["Queued"] * 4
    assert all(s.message.startswith("Queued: waiting for 1 CPU on one node (0 free on n1); earliest start ")
               for s in states)
    assert states[0].message.endswith(" UTC on n1, once node n1's e31 worker answers")
    for before, state in zip(runs, states[1:]):
        assert state.message.endswith(f" UTC on n1, after job {names[before]} ({before[:8]}) ends")


def test_a_submission_sent_twice_creates_one_run(prefect_api, tmp_path):
    """``submit`` gives its request an idempotency key, so the request sent
    again after a 503 (by Prefect's retries or E31's quick ones) returns the
    run the first one created instead of queueing the job twice."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    made = _Pool(tmp_path)
    with get_client(sync_client=True) as client:
        sent: list = []
        send = client._client.send

        def send_twice(request, *args, **kwargs):  # the server answers both sends; the client keeps the second
            if request.url.path.endswith("/create_flow_run"):
                sent.append(send(request, *args, **kwargs).json()["id"])
            return send(request, *args, **kwargs)

        client._client.send = send_twice
        run_id = made.submit(client, "twice")
        client._client.send = send
        key = client.read_flow_run(run_id).idempotency_key
        same_name = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(
            any_=[f"twice-{made.tag}"])))
    assert sent == [run_id]
    assert key.startswith("e31-submit-") and len(key) == len("e31-submit-") + 36
    assert [str(r.id) for r in same_name] == [run_id]


def test_deep_in_the_queue_a_reason_is_rewritten_at_most_once_a_minute(prefect_api, tmp_path, monkeypatch):
    """Beyond the REASON_DEPTH soonest waiting runs (1 here), a run whose
    planner reason is younger than REASON_EVERY_S keeps it when the plan
    moves it by more than DRIFT (counted ``kept``), unless its scheduled
    time nears, while a run that never had a planner reason gets one at
    once, however deep; a deep run's reason names no job it waits for.
    (No worker answers for n1: every run waits; jobs of 30 minutes, so
    cancelling the middle one moves the last one's start 30 minutes
    earlier.)"""
    from prefect.client.orchestration import get_client
    from datetime import datetime, timedelta, timezone

    from prefect.states import Cancelled, Scheduled

    from e31.deployments.scheduler import tick
    from e31.flows.queue import QUEUED, RunCache
    from e31.flows.queue import record

    monkeypatch.setattr(record, "REASON_DEPTH", 1)
    made = _Pool(tmp_path)
    with get_client(sync_client=True) as client:
        runs = [made.submit(client, name, "30m") for name in ("a", "b", "c")]
        cache = RunCache(made.spec, full_every_s=3600)
        first = tick(client, made.spec, cache=cache).counts
        soonest = client.read_flow_run(runs[0]).state.message
        reasons = [(r.id, r.parameters["spec"]["name"], r.created, r.state.message) for r in map(client.read_flow_run, runs)]
        before = client.read_flow_run(runs[2])
        client.set_flow_run_state(runs[1], Cancelled(), force=True)
        moved = tick(client, made.spec, cache=cache).counts
        kept = client.read_flow_run(runs[2])
        # every reason counts as old: below 0, since the age is judged on the scheduler's estimate of the server's
        # clock (whole-second Date headers), which may lag the state's timestamp by a second
        monkeypatch.setattr(record, "REASON_EVERY_S", -60.0)
        again = tick(client, made.spec, cache=cache).counts
        last = client.read_flow_run(runs[2])
        # kept so long that its scheduled time nears (10 s away, under AHEAD_S / 4): rewritten however young,
        # before Prefect's late-runs service marks it Late (a new cache: a state set by hand shows at a full read)
        monkeypatch.setattr(record, "REASON_EVERY_S", 3600.0)
        soon = datetime.now(timezone.utc) + timedelta(seconds=10)
        client.set_flow_run_state(runs[2], Scheduled(name=QUEUED, message=last.state.message, scheduled_time=soon),
                                  force=True)
        near = tick(client, made.spec, cache=RunCache(made.spec, full_every_s=3600)).counts
        pushed = client.read_flow_run(runs[2]).next_scheduled_start_time
    assert (first["wait"], first["kept"]) == (3, 0)  # every run's first planner reason, however deep
    assert soonest.endswith(" UTC on n1, once node n1's e31 worker answers"), (soonest, reasons)  # nothing ahead
    assert before.state.message.endswith(" UTC on n1") and ", after job " not in before.state.message  # deep
    assert (moved["wait"], moved["kept"], moved["unchanged"]) == (0, 1, 1)  # the soonest (a) is as it was
    assert (kept.state.message, kept.next_scheduled_start_time) == (before.state.message,
                                                                     before.next_scheduled_start_time)
    assert (again["wait"], again["kept"]) == (1, 0)  # once REASON_EVERY_S has passed it is rewritten
    # 30 minutes earlier: after a (30 min), not after a and b (60 min); its scheduled time is its planned start
    assert 1500 < (before.next_scheduled_start_time - last.next_scheduled_start_time).total_seconds() < 2100
    assert (near["wait"], near["kept"]) == (1, 0)
    assert abs((pushed - last.next_scheduled_start_time).total_seconds()) < 60  # pushed back to its planned start


def test_deep_in_the_queue_a_start_within_the_floor_is_no_change(prefect_api, tmp_path, monkeypatch):
    """A deep run (beyond REASON_DEPTH, 1 here) planned to start within
    DEEP_AHEAD_S gets a scheduled time DEEP_AHEAD_S ahead, and a plan that
    moves its start within that is no rewrite (``unchanged``): its reason
    names neither clock-exact start nor the job it waits for."""
    from prefect.client.orchestration import get_client
    from datetime import datetime, timezone

    from prefect.states import Cancelled

    from e31.deployments.scheduler import tick
    from e31.flows.queue import RunCache
    from e31.flows.queue import record

    monkeypatch.setattr(record, "REASON_DEPTH", 1)
    made = _Pool(tmp_path)
    with get_client(sync_client=True) as client:
        runs = [made.submit(client, name) for name in ("a", "b", "c")]  # 5 s each
        cache = RunCache(made.spec, full_every_s=3600)
        first = tick(client, made.spec, cache=cache).counts
        before = client.read_flow_run(runs[2])
        client.set_flow_run_state(runs[1], Cancelled(), force=True)
        moved = tick(client, made.spec, cache=cache).counts
        after = client.read_flow_run(runs[2])
        ahead_s = (before.next_scheduled_start_time - datetime.now(timezone.utc)).total_seconds()
    assert first["wait"] == 3
    assert record.DEEP_AHEAD_S - 60 < ahead_s <= record.DEEP_AHEAD_S  # record uses pace.DEEP_AHEAD_S
    assert (moved["wait"], moved["kept"], moved["unchanged"]) == (0, 0, 2)
    assert (after.state.message, after.next_scheduled_start_time) == (before.state.message,
                                                                       before.next_scheduled_start_time)


def test_a_prefetchers_staged_tag_is_read_at_each_tick_only_where_a_node_prefetches(prefect_api, tmp_path):
    """The tags a node's prefetcher puts on a queued run (``e31-staged``,
    ``e31-staged:NODE``) are read at the next incremental read when a node
    of the pool has a ``scratch_budget``; without one no tick asks for them
    (nobody tags), and a tag put anyway shows at the next full read."""
    from prefect.client.orchestration import get_client

    from e31.flows.queue import RunCache

    seen = {}
    for budget in ("1GiB", None):
        made = _Pool(tmp_path, **({"scratch_budget": budget} if budget else {}))
        with get_client(sync_client=True) as client:
            run = made.submit(client, "a")
            cache = RunCache(made.spec, full_every_s=3600, margin_s=0)  # margin 0: the submission is not read again
            cache.read(client)
            client.update_flow_run(run, tags=["e31", "e31-staged", "e31-staged:n1"])
            cache.read(client)
            incremental = sorted(cache.runs[run].tags)
            cache.read(client, full=True)
            seen[budget] = (cache.prefetching, incremental, sorted(cache.runs[run].tags))
    staged = ["e31", "e31-staged", "e31-staged:n1"]
    assert seen == {"1GiB": (True, staged, staged), None: (False, ["e31"], staged)}


def test_a_fresh_crash_holds_its_node_until_it_settles(prefect_api, tmp_path):
    """Prefect's worker writes ``Crashed`` as a flow process exits non-zero,
    a moment before the e31 worker holds a run whose return it cut
    ``Pending``: until the crash is :data:`SETTLE_S` seconds old the run
    keeps its node in the snapshot (another job placed there ran beside the
    return), then it is freed (no retries: not queued again)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Running

    from e31.flows.queue import SETTLE_S, read, work_pool_name

    made = _Pool(tmp_path)
    with get_client(sync_client=True) as client:
        run = made.submit(client, "crash")
        client.send_worker_heartbeat(work_pool_name(made.spec), "n1")  # n1's worker is alive (as a worker's beat)
        place_by_hand(client, run, "n1")
        client.set_flow_run_state(run, Running(), force=True)
        client.set_flow_run_state(run, Crashed(message="Process exited with status code: -9."), force=True)
        at = client.read_flow_run(run).state.timestamp.timestamp()
        fresh = read(client, made.spec, now=at + SETTLE_S - 0.5)
        settled = read(client, made.spec, now=at + SETTLE_S + 0.5)
    assert [(r.id, r.node, r.cpus) for r in fresh.running if r.id in fresh.runs] == [(run, "n1", 1)]
    assert [r.id for r in settled.running if r.id in settled.runs] == [] and settled.requeue == []


def test_a_cut_return_its_worker_cannot_finish_crashes_the_run_and_frees_its_node(prefect_api, tmp_path):
    """A run held ``Pending`` (``Returning``) whose cut return its worker
    could not deliver (the store away, the job's lock held) held its node
    until its lease; ``give_up_returning`` crashes it, saying where the
    output is, so the node is freed once the crash settles.  A run in any
    other state is left alone."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Pending, Running

    from e31.deployments.cutreturn import RETURNING, give_up_returning
    from e31.flows.queue import SETTLE_S, read, work_pool_name

    made = _Pool(tmp_path)
    with get_client(sync_client=True) as client:
        run, other = made.submit(client, "cut"), made.submit(client, "running")
        client.send_worker_heartbeat(work_pool_name(made.spec), "n1")
        for key in (run, other):
            place_by_hand(client, key, "n1")
            client.set_flow_run_state(key, Running(), force=True)
        client.set_flow_run_state(run, Crashed(message="Process exited with status code: -9."), force=True)
        client.set_flow_run_state(run, Pending(name=RETURNING), force=True)
        assert give_up_returning(run) is True and give_up_returning(other) is False
        state = client.read_flow_run(run).state
        settled = read(client, made.spec, now=state.timestamp.timestamp() + SETTLE_S + 0.5)
        assert client.read_flow_run(other).state.type.value == "RUNNING"
    assert (state.type.value, state.message) == ("CRASHED", (
        "its flow process ended during the return of its output, and its worker could not finish that return; the "
        "output stays in the node's scratch (e31 return JOB there, or the job's next run there, delivers it)"))
    assert [r.id for r in settled.running if r.id in settled.runs] == [other]


class _CancelAround(_CancelAfter):
    """A cancel as ``e31 cancel`` makes it of a queued run, split around the
    scheduler's placement of ``victim``: the server's own ``Cancelled`` (no
    message) just after the scheduler's check, the canceller's ``Cancelled``
    with its message just after the scheduler's ``Placed``."""

    def __getattr__(self, name):
        call = getattr(self._client, name)
        if name not in ("read_flow_run", "set_flow_run_state"):
            return call

        def around(run_id, *args, **kwargs):
            from prefect.states import Cancelled

            answer = call(run_id, *args, **kwargs)
            if str(run_id) == self.victim and name == "read_flow_run" and not self.fired:
                self.fired = True
                self._client.set_flow_run_state(run_id, Cancelled(), force=True)
            elif str(run_id) == self.victim and name == "set_flow_run_state" and self.fired and args and \
                    getattr(args[0], "name", None) == "Placed":
                self._client.set_flow_run_state(run_id, Cancelled(message="cancelled while queued"), force=True)
            return answer
        return around


def test_a_placement_that_overtook_a_cancel_leaves_the_cancellers_own_message(prefect_api, tmp_path):
    """The scheduler's undo of a placement that overtook a cancel must not
    set again the state before its write, the server's ``Cancelled`` with
    no message, over the canceller's own ``Cancelled`` written after the
    placement (the run's message then said nothing).  A final state after
    the write is left as it is."""
    from prefect.client.orchestration import get_client

    from e31.deployments.scheduler import tick
    from e31.flows.queue import RunCache, work_pool_name

    made = _Pool(tmp_path)
    with get_client(sync_client=True) as client:
        victim = made.submit(client, "victim")
        cache = RunCache(made.spec, full_every_s=3600)
        client.send_worker_heartbeat(work_pool_name(made.spec), "n1")
        injected = _CancelAround(client, victim, "read_flow_run")
        result = tick(injected, made.spec, cache=cache, lease_s=60.0)
        states = [(s.type.value, s.name, s.message) for s in client.read_flow_run_states(victim)]
    assert injected.fired and result.counts["undone"] == 1 and result.counts["start"] == 0, str(result.counts)
    assert victim not in cache.runs
    assert [s[:2] for s in states[-3:]] == [("CANCELLED", "Cancelled"), ("SCHEDULED", "Placed"), ("CANCELLED", "Cancelled")]
    assert states[-1][2] == "cancelled while queued"


def test_a_submission_the_filters_miss_is_read_by_the_id_its_event_named(prefect_api, tmp_path):
    """On a busy server a submission may be committed 52 s after ``e31
    submit`` computed its scheduled time, so its expected start falls before
    the filter for new runs (``since + AHEAD_S``); it must not wait ~60 s
    for the next full read.  A run the server's events named
    (:meth:`RunCache.hear`, fed by the scheduler's event stream) that no
    filter returned is read by its id."""
    import time
    from datetime import datetime, timedelta, timezone

    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    from e31.flows.deploy import parameters
    from e31.flows.queue import AHEAD_S, QUEUED, RunCache, ensure_pool

    made = _Pool(tmp_path)
    with get_client(sync_client=True) as client:
        cache = RunCache(made.spec, full_every_s=3600)
        first = made.submit(client, "first")
        assert {str(r.id) for r in cache.read(client)} == {first}  # the first read: every active run
        time.sleep(1.0)
        late = str(client.create_flow_run_from_deployment(  # as a submission whose time was computed 40 s before
            ensure_pool(client, made.spec, made.template), parameters=parameters(_spec(f"late-{made.tag}", tmp_path),
                                                                                 None),
            name="late", state=Scheduled(name=QUEUED, scheduled_time=datetime.now(timezone.utc) + timedelta(
                seconds=AHEAD_S - 40))).id)
        assert {str(r.id) for r in cache.read(client)} == {first}  # missed by the filters (the old code read no more)
        cache.hear({late, first})
        assert {str(r.id) for r in cache.read(client)} == {first, late} and cache.heard == set()
        assert cache.full_reads == 1


def test_the_start_after_placement_and_the_return_are_measured_and_planned(prefect_api, tmp_path):
    """A run seen ``Placed`` then ``Running`` gives its node's start latency; a completed run's work-ended tag
    and end give its job's return time; a queued job's occupancy then holds both (a running one, the return)."""
    from datetime import timedelta

    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Running, Scheduled

    from e31.deployments.scheduler import history
    from e31.flows.queue import RunCache, read
    from e31.tasks.supervisor.marks import WORK_ENDED

    made = _Pool(tmp_path)
    pool = made.spec
    with get_client(sync_client=True) as client:
        done = made.submit(client, "done")
        place_by_hand(client, done, "n1")
        client.set_flow_run_state(done, Running(), force=True)
        run = client.read_flow_run(done)
        ended = run.state.timestamp  # the work "ended" as it started; the run ends 42 s later by the tags' clock
        client.set_flow_run_state(done, Completed(), force=True)
        end = client.read_flow_run(done).end_time
        work_end = (end - timedelta(seconds=42)).strftime("%Y-%m-%dT%H:%M:%SZ")
        client.update_flow_run(done, tags=[*run.tags, f"{WORK_ENDED}{run.run_count}:{work_end}"])
        assert ended is not None
        past = history(client, pool)
        name = f"done-{made.tag}"
        assert 42.0 <= past.returns[name] < 43.0, past.returns

        cache = RunCache(pool, full_every_s=3600)
        moving = made.submit(client, "moving")
        place_by_hand(client, moving, "n1")
        placed = client.set_flow_run_state(moving, Scheduled(name="Placed"), force=True).state
        read(client, pool, cache=cache)  # sees it Placed
        running = client.set_flow_run_state(moving, Running(), force=True).state
        read(client, pool, cache=cache)  # sees it Running: one start latency for n1
        latency = running.timestamp.timestamp() - placed.timestamp.timestamp()
        assert cache.overheads.start_s("n1") == latency > 0

        queued = made.submit(client, "done")  # the job measured above, queued again
        snap = read(client, pool, cache=cache, returns=past.returns)
        (job,) = [j for j in snap.queued if j.id == queued]
        assert (job.start_s, job.output_s) == (latency, past.returns[name])
        assert job.occupancy_s == latency + 5.0 + past.returns[name]  # duration 5s
        (held,) = [r for r in snap.running if r.id == moving]
        assert held.expected_end == held.start + 5.0  # no return measured for its job


def test_runs_submitted_a_moment_ahead_of_the_schedulers_clock_keep_their_order(prefect_api, tmp_path, monkeypatch):
    """The scheduler judges server timestamps on its estimate of the server's
    clock (whole-second ``Date`` headers: it may lag by a second).  Runs
    created within that lag keep their submission order: clamped to the
    estimate's "now" they tied and went in the order of their random ids.
    (No worker answers for n1: every run waits, each after the one before.)"""
    import time

    from prefect.client.orchestration import get_client

    from e31.deployments.scheduler import tick
    from e31.flows.queue import RunCache
    from e31.flows.queue import snapshot

    made = _Pool(tmp_path)
    with get_client(sync_client=True) as client:
        runs = [made.submit(client, name, "30m") for name in ("a", "b", "c", "d")]
        monkeypatch.setattr(snapshot, "server_now", lambda: time.time() - 5.0)  # the estimate 5 s behind
        tick(client, made.spec, cache=RunCache(made.spec, full_every_s=3600))
        messages = [client.read_flow_run(r).state.message for r in runs]
        names = {r: _name(client, r) for r in runs}
    assert messages[0].endswith(" UTC on n1, once node n1's e31 worker answers"), messages
    for before, message in zip(runs, messages[1:]):
        assert message.endswith(f" UTC on n1, after job {names[before]} ({before[:8]}) ends"), messages
