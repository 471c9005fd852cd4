"""The scheduler's wakeups from a real ``prefect server start``'s event
stream: a submission, a requeue and a run's end wake it; a waiting run's
reason rewritten (``Queued`` from ``Queued``, the scheduler's own writes)
does not."""

from __future__ import annotations

import time

from tests.deployments.test_run_cache import _Pool


def test_the_scheduler_wakes_on_submissions_and_ends_not_on_its_own_reason_rewrites(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Crashed, Running, Scheduled

    from e31.deployments.runevents import SCHEDULER_EVENTS, Wakeup, own_rewrite
    from e31.flows.queue import QUEUED, ensure_pool, work_pool_name

    made = _Pool(tmp_path)
    with get_client(sync_client=True) as client:
        ensure_pool(client, made.spec, made.template)
        wake = Wakeup(work_pool_name(made.spec), SCHEDULER_EVENTS, ignore=own_rewrite)
        try:
            deadline = time.monotonic() + 60
            while not wake.connected:
                assert time.monotonic() < deadline, "the event stream never came up"
                time.sleep(0.1)
            run = made.submit(client, "a")  # a submission: Queued from nothing
            assert wake.wait(30) and (wake.events, wake.ignored) == (1, 0)
            assert wake.take_runs() == {run} and wake.take_runs() == set()  # its id, for the scheduler's read

            later = Scheduled(name=QUEUED, message="Queued: waiting for 1 CPU; earliest start 03:00:00 UTC")
            client.set_flow_run_state(run, later, force=True)  # the scheduler's rewrite: Queued from Queued
            client.set_flow_run_state(run, Running(), force=True)
            client.set_flow_run_state(run, Crashed(message="lost"), force=True)  # wakes: a crash frees a node
            assert wake.wait(30)
            deadline = time.monotonic() + 30
            while wake.ignored < 1:  # the rewrite's event came before the crash's: ignored, not lost
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert (wake.events, wake.ignored) == (2, 1)

            client.set_flow_run_state(run, Scheduled(name=QUEUED, message="Queued: retry 1 of 1"), force=True)
            assert wake.wait(30) and (wake.events, wake.ignored) == (3, 1)  # a requeue: Queued from Crashed

            client.set_flow_run_state(run, Scheduled(name=QUEUED, message="Queued: other reason"), force=True)
            client.set_flow_run_state(run, Running(), force=True)
            client.set_flow_run_state(run, Completed(), force=True)
            assert wake.wait(30)
            deadline = time.monotonic() + 30
            while wake.ignored < 2:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert (wake.events, wake.ignored) == (4, 2)
            assert wake.take_runs() == {run}  # the crash, requeue and end; not the rewrites (ignored)
            assert not wake.wait(2)  # nothing else came
        finally:
            wake.close()


def test_a_workers_poll_asks_the_server_after_a_placement_or_every_quiet_interval(monkeypatch):
    """PollGate: until the event stream is up every poll asks; once it is,
    a poll asks only after a Placed event since the last one that asked, or
    QUIET_POLL_S (10 s) after it; a lost stream makes every poll ask again."""
    from e31.deployments import runevents

    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    gate = runevents.PollGate()
    assert gate.quiet_s == runevents.QUIET_POLL_S == 10.0
    assert [gate.ask(), gate.ask()] == [True, True]  # no stream yet: Prefect's poll interval
    gate.connected(True)
    clock[0] = 101.0
    assert [gate.ask(), gate.ask()] == [False, False]  # the last asked 1 s ago, and nothing was placed since
    gate.seen()
    clock[0] = 102.0
    assert [gate.ask(), gate.ask()] == [True, False]  # a placement: ask once
    clock[0] = 111.9
    assert gate.ask() is False
    clock[0] = 112.0
    assert [gate.ask(), gate.ask()] == [True, False]  # the quiet interval's own poll
    gate.connected(False)
    assert [gate.ask(), gate.ask()] == [True, True]
    assert (gate.placed, gate.asked) == (1, 6)


def test_a_worker_polls_at_once_only_for_placements_on_its_own_node(monkeypatch):
    """poll_on_placements: the scheduler's announcement of a run placed on
    this node, or on no node, makes the worker poll (and tells its PollGate); one naming
    another node does nothing.  The server's event stream is played by a
    stand-in for ``follow`` (the stream itself: the test above and
    test_queue's wakeup test, on a real server)."""
    import asyncio
    import logging

    from prefect.events.schemas.events import Event

    from e31.deployments import runevents

    def placed(node: str | None) -> Event:  # as the scheduler sends it (e31.flows.queue.announce)
        resource = {"prefect.resource.id": "prefect.flow-run.1f0e2d3c-0000-4000-8000-000000000000",
                    **({"e31.node": node} if node else {})}
        return Event(event="e31.flow-run.placed", resource=resource,
                     related=[{"prefect.resource.id": "prefect.tag.e31-placed:n1", "prefect.resource.role": "tag"}])

    # the tag (a stale copy, as the server's own events may carry) is not read: the node label is
    stream = [placed("n2"), placed("n1"), placed("n3"), placed(None)]

    async def follow(work_pool, states, on_event, connected=None):
        assert (work_pool, states) == ("e31-pool", ("e31.flow-run.placed", "Preempting"))
        connected(True)
        for event in stream:
            on_event(event)
            await asyncio.sleep(0.05)  # each poll runs before the next event
        await asyncio.sleep(3600)

    polls = []

    async def poll():
        polls.append(gate.placed)

    async def main():
        tasks = runevents.poll_on_placements("e31-pool", "n1", gate, poll, logging.getLogger("test"))
        await asyncio.sleep(0.5)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    monkeypatch.setattr(runevents, "follow", follow)
    gate = runevents.PollGate()
    asyncio.run(main())
    assert (gate.up, gate.placed, polls) == (True, 2, [1, 2])  # n1's placement, then the one naming no node


def test_a_run_placed_here_that_a_poll_did_not_get_is_asked_for_again_while_it_waits(monkeypatch):
    """poll_on_placements with placed_here: on PostgreSQL a poll skips the runs another worker's concurrent
    poll has locked, so a run an event named that the poll did not get is looked up; while it still waits on
    this node it is asked for again (every RECHECK_S), and not once it is gone or placed elsewhere."""
    import asyncio
    import logging

    from prefect.events.schemas.events import Event

    from e31.deployments import runevents

    def placed(run: str) -> Event:
        return Event(event="e31.flow-run.placed",
                     resource={"prefect.resource.id": f"prefect.flow-run.{run}", "e31.node": "n1"})

    def played(stream, answers, waiting):
        polls, looked = [], []

        async def follow(work_pool, states, on_event, connected=None):
            connected(True)
            for event in stream:
                on_event(event)
                await asyncio.sleep(0.05)
            await asyncio.sleep(3600)

        async def poll():
            polls.append(time.monotonic())
            return answers.pop(0) if answers else set()

        async def placed_here(run):
            looked.append(run)
            return waiting(run, len(polls))

        async def main():
            tasks = runevents.poll_on_placements("e31-pool", "n1", runevents.PollGate(), poll,
                                                 logging.getLogger("test"), placed_here=placed_here)
            await asyncio.sleep(1.5)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        monkeypatch.setattr(runevents, "follow", follow)
        asyncio.run(main())
        return polls, looked

    # locked by another worker's poll twice, then got: three polls, RECHECK_S apart
    a = "1f0e2d3c-0000-4000-8000-00000000000a"
    polls, looked = played([placed(a)], [set(), set(), {a}], lambda run, n: True)
    assert (len(polls), looked) == (3, [a, a])
    assert all(later - earlier >= runevents.RECHECK_S * 0.9 for earlier, later in zip(polls, polls[1:]))
    # another node's run, or one its worker already took: looked up once, not asked for again
    polls, looked = played([placed(a)], [set()], lambda run, n: False)
    assert (len(polls), looked) == (1, [a])
    # got at once: nothing looked up
    polls, looked = played([placed(a)], [{a}], lambda run, n: True)
    assert (len(polls), looked) == (1, [])
    # a run that stays locked is asked for RECHECK_TRIES times after the first poll, then left to the quiet poll
    monkeypatch.setattr(runevents, "RECHECK_S", 0.01)
    polls, looked = played([placed(a)], [], lambda run, n: True)
    assert (len(polls), len(looked)) == (runevents.RECHECK_TRIES + 1, runevents.RECHECK_TRIES)
