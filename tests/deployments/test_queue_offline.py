"""The queue's commands where no server is needed: ``e31 worker`` refusing a
node this machine cannot give what the pool file declares, and a command
whose Prefect server does not answer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from e31.deployments.nodecheck import NodeMismatch, check_node
from e31.flows.admission import this_node
from e31.flows.placement import Node


def test_a_worker_refuses_a_node_bigger_than_this_machine_and_names_the_fix():
    here = this_node()
    declared = Node("big", gpus=here.gpus + 8, cpus=here.cpus + 1, memory=here.memory + 2**30)
    with pytest.raises(NodeMismatch) as info:
        check_node(declared)
    assert str(info.value) == (
        f"this machine ({here.name}) cannot be node 'big' of the pool: {here.gpus + 8} GPUs declared, {here.gpus} here; "
        f"{here.cpus + 1} CPUs declared, {here.cpus} here; {(here.memory + 2**30) / 2**30:.1f} GiB of memory declared, "
        f"{here.memory / 2**30:.1f} GiB here; start the worker on a machine that has them, or declare what this one "
        "has in the pool file; to try GPU placement on a machine without them, E31_NODE_GPUS=N makes the worker take "
        "N GPUs as found; to try a pool's placement on a smaller machine, E31_NODE_CPUS=N and E31_NODE_MEMORY=SIZE "
        "make the worker take them as found (for trying only: the work gets what this machine has)")
    with pytest.raises(NodeMismatch) as info:
        check_node(Node("big", gpus=8, cpus=1, memory=2**20), gpus=4)  # told 4 GPUs: no hint, the count is given
    assert str(info.value).endswith("8 GPUs declared, 4 here; start the worker on a machine that has them, or "
                                    "declare what this one has in the pool file")
    check_node(Node("small", gpus=8, cpus=1, memory=2**20), gpus=8)  # fits: no error


def test_cpus_and_memory_can_be_taken_as_found_to_try_a_larger_pool_node(monkeypatch):
    from e31.deployments.nodecheck import node_overrides
    from e31.errors import InvalidInput

    here = this_node()
    big = Node("big", gpus=0, cpus=here.cpus + 62, memory=(here.memory // 2**20 + 65536) * 2**20)
    with pytest.raises(NodeMismatch) as info:
        check_node(big, cpus=here.cpus + 62)  # CPUs given, memory not: only memory's variable is named
    assert str(info.value).endswith(
        "GiB here; start the worker on a machine that has them, or declare what this one has in the pool file; to try "
        "a pool's placement on a smaller machine, E31_NODE_MEMORY=SIZE make the worker take them as found (for "
        "trying only: the work gets what this machine has)")
    monkeypatch.setenv("E31_NODE_GPUS", "4")
    monkeypatch.setenv("E31_NODE_CPUS", str(here.cpus + 62))
    monkeypatch.setenv("E31_NODE_MEMORY", f"{big.memory // 2**20}MiB")
    assert node_overrides() == (4, here.cpus + 62, big.memory)
    check_node(big, *node_overrides())  # taken as found: no error
    monkeypatch.setenv("E31_NODE_CPUS", "lots")
    with pytest.raises(InvalidInput) as info:
        node_overrides()
    assert str(info.value) == ("E31_NODE_CPUS: must be a whole number of cpus (got 'lots'); set e.g. E31_NODE_CPUS=8, "
                               "or unset it to detect them")
    for digits in ("\u00b2", "\u0663"):  # a superscript two and an Arabic-Indic three: digits, not ASCII ones
        monkeypatch.setenv("E31_NODE_CPUS", digits)
        with pytest.raises(InvalidInput) as info:
            node_overrides()
        assert str(info.value).startswith("E31_NODE_CPUS: must be a whole number of cpus")
    monkeypatch.setenv("E31_NODE_CPUS", "8")
    monkeypatch.setenv("E31_NODE_MEMORY", "much")
    with pytest.raises(InvalidInput) as info:
        node_overrides()
    assert str(info.value) == ("E31_NODE_MEMORY: must be a size such as 64GiB or 512MB (got 'much'); set it so, or "
                               "unset it to detect the memory")


@pytest.mark.parametrize("command", ["queue", "worker", "scheduler"])
def test_a_queue_command_whose_server_does_not_answer_says_how_to_fix_it(tmp_path, command):
    """A worker pointed at a wrong port said it started and retried for ever; every command says it at once."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = tmp_path / "pool.yaml"
    pool.write_text("pool_version: 1\nname: p\nnodes: [{name: n1, cpus: 1, memory: 1GiB}]\n")
    api = f"http://127.0.0.1:{port}/api"
    argv = ["--pool", str(pool), *(["--node", "n1"] if command == "worker" else [])]
    done = subprocess.run([str(Path(sys.executable).with_name("e31")), command, *argv], text=True,
                          capture_output=True, env={**os.environ, "PREFECT_API_URL": api}, timeout=120)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (f"e31: nothing answers at PREFECT_API_URL={api} (Connection refused): is the Prefect server "
                           "running? Start it (prefect server start) or point PREFECT_API_URL at it\n")


def test_a_prefect_api_url_with_a_password_is_said_without_it(tmp_path):
    """A PREFECT_API_URL holding user:password@ (a proxy's basic auth) was echoed whole in the line."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = tmp_path / "pool.yaml"
    pool.write_text("pool_version: 1\nname: p\nnodes: [{name: n1, cpus: 1, memory: 1GiB}]\n")
    done = subprocess.run([str(Path(sys.executable).with_name("e31")), "queue", "--pool", str(pool)], text=True,
                          capture_output=True, timeout=120,
                          env={**os.environ, "PREFECT_API_URL": f"http://ops:Zq7-secret@127.0.0.1:{port}/api"})
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (f"e31: nothing answers at PREFECT_API_URL=http://***@127.0.0.1:{port}/api (Connection "
                           "refused): is the Prefect server running? Start it (prefect server start) or point "
                           "PREFECT_API_URL at it\n")


@pytest.mark.parametrize("suffix", ["", "/"])
def test_a_prefect_api_url_without_api_says_where_the_api_is(prefect_api, tmp_path, suffix):
    """The server's root, not its API: Prefect's client answered with a raw 404 line."""
    pool = tmp_path / "pool.yaml"
    pool.write_text("pool_version: 1\nname: p\nnodes: [{name: n1, cpus: 1, memory: 1GiB}]\n")
    root = prefect_api.removesuffix("/api") + suffix
    done = subprocess.run([str(Path(sys.executable).with_name("e31")), "queue", "--pool", str(pool)], text=True,
                          capture_output=True, env={**os.environ, "PREFECT_API_URL": root}, timeout=120)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (f"e31: PREFECT_API_URL={root} is not a Prefect API address ({root.rstrip('/')}/ready "
                           "answered 404): it ends in /api, e.g. http://127.0.0.1:4200/api; set PREFECT_API_URL so and "
                           "retry\n")


def test_the_worker_starts_its_prefetcher_again_when_it_ends(capsys):
    import time

    from e31.deployments.commands import _Supervised

    _Supervised.RESTART_S = 0.1
    child = _Supervised([sys.executable, "-c", "pass"])  # ends at once, as a killed prefetcher would
    try:
        first = child.proc.pid
        deadline = time.monotonic() + 30
        while child.proc.pid == first:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
        _Supervised.RESTART_S = 5.0
    assert "e31 worker: the prefetcher ended (exit 0); started again" in capsys.readouterr().out


def test_the_scheduler_ticks_again_at_once_only_after_a_placement_or_an_ending():
    """A tick that placed, handed over, refused, crashed, requeued or found a
    run changed is followed by the next at once; one that only wrote or
    deferred waiting runs' reasons (a deep queue always has some) waits for
    the interval or an event."""
    from e31.deployments.scheduler import at_once

    zero = {"start": 0, "handover": 0, "wait": 0, "refuse": 0, "lost": 0, "requeued": 0, "unchanged": 0, "gone": 0,
            "stale": 0, "undone": 0, "deferred": 0, "kept": 0}
    assert [k for k in zero if at_once({**zero, k: 1})] == ["start", "handover", "refuse", "lost", "requeued", "gone",
                                                            "stale", "undone"]
    assert at_once({**zero, "wait": 25, "deferred": 448, "kept": 20, "unchanged": 3}) is False
    assert at_once(zero) is False


def test_a_waiting_runs_planned_start_counts_as_moved_by_the_rules_of_its_depth():
    """pace.start_moved: near the front (not deep), a move of AHEAD_S / 2 (60 s)
    or more; deep in the queue, within DEEP_AHEAD_S no move counts while the
    scheduled time is 30 s or more ahead, and beyond it a move counts from
    DRIFT (a quarter) of the time until the start."""
    from datetime import datetime, timezone

    from e31.flows.queue import pace

    now = 1_000_000.0

    def at(seconds: float) -> datetime:
        return datetime.fromtimestamp(now + seconds, timezone.utc)

    assert pace.AHEAD_S == 120 and pace.DEEP_AHEAD_S == 600 and pace.DRIFT == 0.25
    assert [pace.start_moved(now + 300, at(300 + d), now, deep=False) for d in (0, 59, -59, 60, -61)] == \
        [False, False, False, True, True]
    assert [pace.start_moved(now + 30, at(s), now, deep=False) for s in (120, 61, 59)] == [False, False, True]
    # deep, planned within the floor: only a scheduled time that nears (under 30 s) or stands far beyond it
    assert [pace.start_moved(now + 100, at(s), now, deep=True) for s in (600, 300, 30, 29, 660, 661)] == \
        [False, False, False, True, False, True]
    # deep, planned an hour ahead: a quarter of that (900 s) is no move; more is
    assert [pace.start_moved(now + 3600, at(3600 + d), now, deep=True) for d in (899, -899, 901, -901)] == \
        [False, False, True, True]
    assert pace.start_moved(now + 3600, None, now, deep=True)


def test_a_reason_that_differs_only_in_its_clock_times_has_the_same_shape():
    """A waiting placement's ``shape`` (its reason with every clock time the
    planner's text writes left out: ``clock``, seconds dropped on a whole
    minute, the date when not today's) is what the scheduler compares to
    know whether the words changed; it changes with anything else (here the
    node): a start on a whole minute (``11:24 UTC``, 1 in 60) is no change."""
    from e31.flows.placement import Node, QueuedJob, RunningJob, plan
    from e31.flows.placement.text import clock

    now = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC, a whole minute

    def wait(end: float, on: str = "n1"):
        running = RunningJob("r", on, (), 1, 0, now - 60, end)
        job = QueuedJob(id="q", name="q", gpus=0, cpus=1, memory=0, submitted=now - 1, runtime_s=60.0, limit_s=120.0)
        (p,) = plan([Node(on, 0, 1, 2**30)], [running], [job], now)
        return p

    assert [clock(t, now) for t in (now + 5, now, now + 86400)] == ["08:00:05 UTC", "08:00 UTC",
                                                                     "2027-01-16 08:00 UTC"]
    soon, minute, tomorrow = wait(now + 65), wait(now + 120), wait(now + 86400 + 67)
    assert (soon.reason, soon.ender) == ("waiting for 1 CPU on one node (0 free on n1); earliest start 08:01:05 UTC "
                                         "on n1, after job r ends", "r")
    assert soon.shape == minute.shape == tomorrow.shape != wait(now + 65, "n2").shape
    assert len({soon.reason, minute.reason, tomorrow.reason}) == 3


def test_a_placed_runs_node_is_read_from_its_tag():
    """mapping.placed_on reads the node from the ``e31-placed:NODE`` tag the
    scheduler writes with a placement (the server's Placed events carry the
    run's tags), and nothing from any other tag; placed_tags sets it, the
    other tags kept: a worker then polls at once only for its own node's
    placements (None: it polls, to be safe).  The words (start_reason) are
    not read."""
    from e31.flows.placement.model import QueuedJob
    from e31.flows.placement.reasons import start_reason
    from e31.flows.queue.mapping import placed_on, placed_tags

    job = QueuedJob(id="r1", name="a", gpus=2, cpus=8, memory=2**35, submitted=0.0, runtime_s=60.0, limit_s=120.0)
    start = start_reason(job, "gpu-2.b", 0b11, 3600.0, 0.0)
    assert start.startswith("starts now on gpu-2.b, GPUs 0,1, 8 CPUs, 32 GiB")
    tags = placed_tags(["e31", "e31-staged", "e31-staged:n3", "e31-placed:n1"], "gpu-2.b")
    assert tags == ["e31", "e31-staged", "e31-staged:n3", "e31-placed:gpu-2.b"]
    assert [placed_on(t) for t in (tags, ["e31-placed:gpu-2.b"], ["e31-placed:n3", "e31"])] == \
        ["gpu-2.b", "gpu-2.b", "n3"]
    assert [placed_on(t) for t in (None, [], ["e31-staged:n1"], placed_tags(tags, None))] == [None, None, None, None]


@pytest.mark.parametrize("option, value, error", [
    ("--lease", "0", "argument --lease: 0 seconds: give at least 10 (a worker's heartbeat comes every 10 s: a "
                     "shorter lease takes live nodes for lost and crashes their runs)"),
    ("--interval", "-1", "argument --interval: -1 seconds: give more than 0 (the seconds between ticks)"),
    ("--handover", "-5", "argument --handover: -5 seconds: give at least 0 (0 turns handovers off)"),
])
def test_the_scheduler_refuses_a_nonsense_number_of_seconds(option, value, error, tmp_path):
    """--lease 0 (every node lost at the first tick), --interval -1 and
    --handover -5 are refused, not run for a tick that exits 0."""
    out = subprocess.run([str(Path(sys.executable).with_name("e31")), "scheduler", "--pool", str(tmp_path / "p.yaml"),
                          option, value, "--once"], capture_output=True, text=True)
    assert (out.returncode, out.stdout, out.stderr.splitlines()[-1]) == (2, "", f"e31 scheduler: error: {error}")


def test_a_flow_process_is_fenced_only_by_a_placement_on_another_node():
    """``placed_elsewhere``: the node a run names in its ``placement``
    parameter when that is not this process's; nothing for a run queued
    again (no node), placed back here, or outside a queue (no node of its
    own).  A run without that parameter (placed by an older E31, or by
    hand) is read from its ``job_variables``; the parameter comes first."""
    from types import SimpleNamespace

    from e31.tasks.supervisor.fence import placed_elsewhere

    def run(**placement):  # job variables naming another node: the parameter's node comes first
        return SimpleNamespace(parameters={"spec": {}, "placement": placement},
                               job_variables={"e31_node": "n9"} if "e31_node" in placement else {})

    assert placed_elsewhere(run(e31_node="n2", e31_attempt=1), "n1") == "n2"
    assert placed_elsewhere(run(e31_node="n1", e31_attempt=1), "n1") is None
    assert placed_elsewhere(run(e31_attempt=1), "n1") is None  # queued again, not placed yet
    assert placed_elsewhere(run(e31_node="n2"), None) is None  # not started by an e31 worker
    assert placed_elsewhere(SimpleNamespace(parameters={"spec": {}}, job_variables=None), "n1") is None
    assert placed_elsewhere(SimpleNamespace(parameters={"spec": {}}, job_variables={"e31_node": "n2"}), "n1") == "n2"
    requeued = {"spec": {}, "placement": {"e31_attempt": 1}}  # a requeue's placement, then a node given by hand
    assert placed_elsewhere(SimpleNamespace(parameters=requeued, job_variables={"e31_node": "n2"}), "n1") == "n2"
    assert placed_elsewhere(SimpleNamespace(parameters=requeued, job_variables={}), "n1") is None


def test_e31_queue_says_what_each_node_holds_and_when_its_worker_was_heard():
    """``node_lines``: per node, what its runs hold against what it has, and
    its worker heard lately, silent past two heartbeats (with what the
    lease then does), or never heard; ``silent_note`` for a run there."""
    from types import SimpleNamespace

    from e31.deployments.runwords import node_lines, silent_note
    from e31.flows.placement import Node, RunningJob

    nodes = [Node("g", gpus=8, cpus=16, memory=64 * 2**30), Node("c", gpus=0, cpus=4, memory=2**30),
             Node("new", gpus=0, cpus=4, memory=2**30)]
    running = [RunningJob(id="a", node="g", devices=(0, 1, 2, 3, 4, 5), cpus=3, memory=12 * 2**30, start=0.0,
                          expected_end=100.0),
               RunningJob(id="~down~c", node="c", devices=(), cpus=4, memory=2**30, start=0.0, expected_end=60.0)]
    snap = SimpleNamespace(nodes=nodes, running=running, runs={"a": object()}, heard={"g": 997.0, "c": 955.0},
                           lease_s=60.0, scheduler_heard=False)
    assert node_lines(snap, 1000.0) == [
        ("g", "GPUs 6/8, CPUs 3/16, memory 12 GiB/64 GiB; 1 run(s)", "heard 3 s ago"),
        ("c", "CPUs 0/4, memory 0 B/1 GiB; 0 run(s)", "late: last heard 45 s ago; it holds no run; nothing new is "
              "placed here from the lease's end at 00:16:55 UTC (60 s unless e31 scheduler --lease says otherwise; "
              "no scheduler heard) until it is heard again"),
        ("new", "CPUs 0/4, memory 0 B/1 GiB; 0 run(s)",
         "no worker heard: nothing starts here until one runs (e31 worker --node new)")]
    snap.lease_s, snap.scheduler_heard = 20.0, True  # the live scheduler's --lease 20, read by e31 queue
    assert node_lines(snap, 1000.0)[1][2] == ("lost: last heard 45 s ago, past the lease that ended at 00:16:15 "
                                              "UTC: nothing is placed here until its worker is heard again")
    snap.heard["g"], snap.lease_s = 955.0, 30.0  # a silent node with a run: what the lease does to it
    assert node_lines(snap, 1000.0)[0][2] == (
        "late: last heard 45 s ago, past the lease that ended at 00:16:25 UTC: nothing new is placed here; its runs "
        "keep their resources unless it is still silent at 00:16:40 UTC, when it is lost")
    assert node_lines(snap, 980.0)[0][2] == (
        "late: last heard 25 s ago; its runs keep their resources until the lease ends at 00:16:25 UTC")
    snap.heard["g"] = 997.0
    assert silent_note(snap, "c", 1000.0) == "; node c's worker is late: last heard 45 s ago"
    assert silent_note(snap, "g", 1000.0) == ""
    assert silent_note(snap, "new", 1000.0) == ""  # never heard: the node is held, nothing is placed there
    snap.behind = {"b": "a"}  # a run handed over behind a is counted, not only listed
    assert node_lines(snap, 1000.0)[0][1] == ("GPUs 6/8, CPUs 3/16, memory 12 GiB/64 GiB; 1 run(s) and 1 handed over "
                                              "behind (holding nothing yet)")


def test_e31_queue_and_submit_name_every_node_of_a_gang_and_count_it_on_each():
    """A two-node job: its row and ``e31 submit``'s plan name both nodes (``g1+g2``, the devices on each),
    and each node's line counts what the gang holds there."""
    from types import SimpleNamespace

    from e31.deployments.runwords import describe, node_lines
    from e31.flows.placement import Node, RunningJob
    from e31.flows.placement.text import where

    nodes = [Node("g1", gpus=8, cpus=16, memory=64 * 2**30), Node("g2", gpus=8, cpus=16, memory=64 * 2**30)]
    gang = RunningJob(id="a", node="g1", devices=(0, 1), cpus=3, memory=2**30, start=0.0, expected_end=100.0,
                      gang=(("g2", (4, 5)),))
    snap = SimpleNamespace(nodes=nodes, running=[gang], runs={"a": object()}, heard={"g1": 997.0, "g2": 997.0},
                           lease_s=60.0, scheduler_heard=True)
    assert [line[1] for line in node_lines(snap, 1000.0)] == [
        "GPUs 2/8, CPUs 3/16, memory 1 GiB/64 GiB; 1 run(s)", "GPUs 2/8, CPUs 3/16, memory 1 GiB/64 GiB; 1 run(s)"]
    assert where("g1", (0, 1), (("g2", (4, 5)),)) == ("g1+g2", "0,1+4,5")
    assert where("c1", (), (("c2", ()),)) == ("c1+c2", "-+-") and where("c1", ()) == ("c1", "-")
    assert where(None, ()) == ("-", "-")
    start = SimpleNamespace(action="start", node="c1", devices=(), gang=(("c2", ()),), reason="")
    assert describe(start) == "start now on c1+c2"


def test_the_worker_s_base_environment_is_prefect_s_computed_once_per_settings():
    """``E31JobConfiguration._base_environment``: what Prefect's gives, with
    the version check off (the worker made it) unless set otherwise, a copy
    each time (a run's change does not reach the next), and computed anew
    under other settings."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.base import BaseJobConfiguration

    from e31.deployments.worker import E31JobConfiguration

    first = E31JobConfiguration._base_environment()
    assert first == {**BaseJobConfiguration._base_environment(), "PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED": "false"}
    first["E31_SCRIBBLE"] = "1"
    assert "E31_SCRIBBLE" not in E31JobConfiguration._base_environment()
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert E31JobConfiguration._base_environment()["PREFECT_API_URL"] == "http://127.0.0.1:9/api"
    with temporary_settings({"PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED": True}):  # set: kept
        assert E31JobConfiguration._base_environment()["PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED"] == "True"
    assert E31JobConfiguration._base_environment() == \
        {**BaseJobConfiguration._base_environment(), "PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED": "false"}


def test_a_node_whose_runs_hold_more_than_it_has_is_planned_full_until_the_longest_holder_ends():
    """Two runs on a 2-GPU, 2-CPU node that together hold more than it has
    (a run started by hand, a crash reported before its worker held the
    run): the planner's input check refused them, and every tick of the
    scheduler failed.  ``clip_overbooked`` counts each GPU, CPU and byte
    for the run holding it longest, so the node is full until that run's
    end, and says what the runs hold."""
    from e31.flows.placement import QueuedJob, RunningJob, plan
    from e31.flows.placement.model import PlanInputError
    from e31.deployments.runwords import node_lines
    from e31.flows.queue.corrections import clip_overbooked
    from e31.flows.queue.snapshot import Snapshot

    gib = 2**30
    node = Node("n1", gpus=2, cpus=2, memory=4 * gib)
    running = [RunningJob(id="early", node="n1", devices=(0, 1), cpus=2, memory=3 * gib, start=0.0,
                          expected_end=110.0),
               RunningJob(id="late", node="n1", devices=(1,), cpus=1, memory=2 * gib, start=0.0,
                          expected_end=150.0)]
    waiting = QueuedJob(id="w", name="w", gpus=2, cpus=2, memory=4 * gib, submitted=0.0, runtime_s=10.0,
                        limit_s=10.0)
    with pytest.raises(PlanInputError):
        plan([node], running, [waiting], 100.0)
    snap = Snapshot(now=100.0, nodes=[node], running=list(running))
    clip_overbooked(snap)
    assert snap.overbooked == {"n1": "2 runs hold CPUs 3 of its 2, memory 5 GiB of its 4 GiB, GPUs 0,1,1 of its 2"}
    assert [(r.id, r.devices, r.cpus, r.memory) for r in snap.running] == [
        ("early", (0,), 1, 2 * gib), ("late", (1,), 1, 2 * gib)]
    [placement] = plan(snap.nodes, snap.running, [waiting], 100.0)
    assert (placement.action, placement.start) == ("wait", 150.0)
    snap.heard, snap.lease_s, snap.scheduler_heard = {"n1": 99.0}, 60.0, True
    assert node_lines(snap, 100.0) == [("n1", "more than it has: 2 runs hold CPUs 3 of its 2, memory 5 GiB of its "
                                              "4 GiB, GPUs 0,1,1 of its 2", "heard 1 s ago")]  # not the clipped use
    cpu_only = Snapshot(now=100.0, nodes=[Node("c", gpus=0, cpus=1, memory=gib)], running=[
        RunningJob(id=k, node="c", devices=(), cpus=1, memory=0, start=0.0, expected_end=110.0) for k in "ab"])
    clip_overbooked(cpu_only)
    assert cpu_only.overbooked == {"c": "2 runs hold CPUs 2 of its 1, memory 0 B of its 1 GiB"}
    within = Snapshot(now=100.0, nodes=[node], running=running[1:])
    clip_overbooked(within)
    assert within.overbooked == {} and within.running == running[1:]


def test_e31_submit_and_queue_say_when_no_scheduler_beats_for_the_pool():
    """With the pool's scheduler killed, e31 submit must not say only
    ``start now on n-1`` with nothing saying that nobody will place it.
    The claim's last beat decides: none, or older than STALE_S (30 s): no
    scheduler; older than two beats (20 s): it may have stopped; else
    nothing to say."""
    import types

    from e31.deployments.presence import scheduler_note

    now = 1_800_000_000.0

    class _Api:
        def __init__(self, claim):
            self.claim = claim

        def read_variable_by_name(self, name):
            assert name == "e31-scheduler-lab"
            return None if self.claim is None else types.SimpleNamespace(value=self.claim)

    none = ("no e31 scheduler serves pool lab: the plan shown is what one would do; nothing is placed or started "
            "until one runs (e31 scheduler --pool pool.yaml)")
    assert scheduler_note(_Api(None), "lab", "pool.yaml", now) == none
    assert scheduler_note(_Api({"id": "a", "lease_s": 60, "beat": now - 31}), "lab", "pool.yaml", now) == none
    assert scheduler_note(_Api({"id": "a", "lease_s": 60, "beat": now - 25}), "lab", "pool.yaml", now) == (
        "pool lab's e31 scheduler was last heard 25 s ago (it beats every 10 s): it may have stopped; a standby "
        "takes over 30 s after its last beat")
    assert scheduler_note(_Api({"id": "a", "lease_s": 60, "beat": now - 5}), "lab", "pool.yaml", now) is None


@pytest.mark.parametrize("command", [["queue", "--pool", "POOL"], ["submit", "--pool", "POOL", "JOB"],
                                     ["deploy", "JOB", "--pool", "POOL"], ["scheduler", "--pool", "POOL"],
                                     ["worker", "--pool", "POOL", "--node", "n1"]], ids=lambda c: c[0])
def test_a_command_whose_server_accepts_and_never_answers_says_so_within_the_api_timeout(tmp_path, command):
    """A frozen Prefect server (a real socket that accepts connections and never answers): every command
    that talks to it says so in one line after ``E31_API_TIMEOUT_S`` seconds; before, it waited for as
    long as the server stayed frozen (Prefect's client's 60 s timeout, then its retries)."""
    import time

    pool = tmp_path / "pool.yaml"
    pool.write_text("pool_version: 1\nname: p\nnodes: [{name: n1, cpus: 1, memory: 1GiB}]\n")
    job = tmp_path / "job.yaml"
    job.write_text("name: j\nwork: {kind: processing, command: [\"true\"]}\nrequest: {limit: 1m}\n"
                   f"output: {{kind: files, url: {tmp_path / 'out'}, files: [a.txt]}}\n")
    args = [str(pool) if a == "POOL" else str(job) if a == "JOB" else a for a in command]
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(8)
        api = f"http://127.0.0.1:{frozen.getsockname()[1]}/api"
        began = time.monotonic()
        done = subprocess.run([str(Path(sys.executable).with_name("e31")), *args], text=True, capture_output=True,
                              env={**os.environ, "PREFECT_API_URL": api, "E31_API_TIMEOUT_S": "2"}, timeout=120)
        took = time.monotonic() - began
    assert (done.returncode, done.stdout, done.stderr) == (1, "", (
        f"e31: the Prefect server at {api} did not answer within 2 s (E31_API_TIMEOUT_S): it is frozen or "
        "overloaded; check its process and its database, then retry\n"))
    assert took < 30  # 2 s asked: a bound, not a speed


def test_a_stopping_scheduler_gives_a_frozen_server_a_few_seconds_for_its_claim():
    """``e31 scheduler`` must not ignore SIGTERM for 16 s while its server is down (the deletion of its claim on
    the pool went through the client's retries).  Against a real Prefect client and a
    server that accepts and never answers, the deletion is given ``wait_s`` and the stop goes on; the claim
    then ends by itself (STALE_S)."""
    import socket
    import time

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from e31.deployments.presence import release_pool

    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)
    try:
        with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{frozen.getsockname()[1]}/api"}):
            with get_client(sync_client=True) as client:
                began = time.monotonic()
                assert release_pool(client, "p", "me", wait_s=1.0) is False
                waited = time.monotonic() - began
    finally:
        frozen.close()
    assert waited < 30  # not the client's 60 s timeout and its retries (a bound, not a speed: 1 s asked)


def test_a_running_job_whose_deadline_has_passed_stays_in_the_queue_s_view():
    """Its spec is read as of its submission (the deadline was in the future then): a scheduler, ``e31
    queue`` or ``e31 cancel`` started after the deadline still sees the run holding its node."""
    from datetime import datetime, timedelta, timezone
    from types import SimpleNamespace

    from e31.flows.queue.mapping import stored_spec
    from e31.specs.errors import SpecError

    created = datetime.now(timezone.utc) - timedelta(hours=2)
    spec = {"name": "late", "work": {"kind": "training", "command": ["true"]},
            "request": {"gpus": 0, "cpus": 1, "limit": "3h", "deadline": (created + timedelta(hours=1)).isoformat()},
            "output": {"kind": "results", "url": "/tmp/out", "files": ["r.json"]}}
    run = SimpleNamespace(created=created, parameters={"spec": spec})
    assert stored_spec(run).request.deadline == created + timedelta(hours=1)
    with pytest.raises(SpecError, match="request.deadline: must be in the future; this deadline has already passed"):
        stored_spec(SimpleNamespace(created=None, parameters={"spec": spec}))  # no creation time: as of now


def test_a_tick_that_timed_out_against_a_frozen_server_is_said_as_server_unanswering(monkeypatch):
    """A request of the tick timed out and the readiness check is not answered either (a real socket that
    accepts and never answers): the kind names the server, not the library's exception."""
    import httpx
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from e31.deployments.scheduler import _failure

    monkeypatch.setenv("E31_API_TIMEOUT_S", "1")
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)
    api = f"http://127.0.0.1:{frozen.getsockname()[1]}/api"
    try:
        with temporary_settings(updates={PREFECT_API_URL: api}):
            said = _failure(httpx.ReadTimeout("timed out"))
            other = _failure(ValueError("a run changed under us"))
    finally:
        frozen.close()
    assert said == (f"ServerUnanswering: the Prefect server at {api} did not answer within 1 s (E31_API_TIMEOUT_S): "
                    "it is frozen or overloaded; check its process and its database, then retry")
    assert other == "ValueError: a run changed under us"


def test_a_scheduled_deployment_run_counts_as_submitted_at_its_scheduled_time_once_queued(tmp_path, monkeypatch):
    """A deployment's schedule makes its runs days ahead; once the scheduler had written its Queued reason on
    one, the next tick took its creation as its submission: deadline_within ran from two days before it was
    due, and the run was refused as infeasible (found by an attack)."""
    from datetime import datetime, timedelta, timezone
    from types import SimpleNamespace
    from uuid import uuid4

    from prefect.states import Scheduled

    from e31 import states
    from e31.flows.queue import snapshot
    from e31.specs import load_pool, load_spec

    (tmp_path / "d.yaml").write_text(
        "name: nightly\nwork: {kind: processing, command: [sleep, '1']}\n"
        "request: {gpus: 0, cpus: 1, memory: 1GiB, duration: 10m, deadline_within: 4h}\n"
        f"output: {{kind: files, url: {tmp_path / 'out'}, files: [x]}}\n")
    (tmp_path / "pool.yaml").write_text("pool_version: 1\nname: lab\nnodes: [{name: c, cpus: 4, memory: 8GiB}]\n")
    spec, pool = load_spec(tmp_path / "d.yaml"), load_pool(tmp_path / "pool.yaml")
    now, due = datetime(2026, 12, 7, 2, 5, tzinfo=timezone.utc), datetime(2026, 12, 7, 2, 0, tzinfo=timezone.utc)
    monkeypatch.setattr(snapshot, "heard", lambda client, pool: {})
    monkeypatch.setattr(snapshot, "read_fences", lambda client, pool, cache=None: {})
    got = []
    for state in (Scheduled(scheduled_time=due), states.queued("Queued: waiting", now + timedelta(seconds=120))):
        run = SimpleNamespace(id=uuid4(), name="nightly", state=state, tags=[], created=due - timedelta(days=2),
                              parameters={"spec": spec.model_dump(mode="json", exclude_none=True)},
                              expected_start_time=due, next_scheduled_start_time=None, job_variables={}, run_count=0,
                              start_time=None, auto_scheduled=True, work_pool_name="lab", deployment_id=uuid4())
        monkeypatch.setattr(snapshot, "read_active", lambda client, pool, run=run: [run])
        snap = snapshot.read(None, pool, now=now.timestamp())
        got.append([(j.submitted, j.deadline) for j in snap.queued])
    assert got == [[(due.timestamp(), (due + timedelta(hours=4)).timestamp())]] * 2
