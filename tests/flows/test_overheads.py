"""Running medians of a job's start after placement (per node) and its output's return (per job)."""

from __future__ import annotations

from datetime import datetime, timezone

from e31.flows.queue.overheads import MAX_S, Overheads, return_seconds
from e31.tasks.supervisor.marks import WORK_ENDED


def test_a_start_is_measured_from_placed_to_running_per_node():
    o = Overheads(keep=3)
    assert o.start_s("n1") == 0.0
    for run, placed, running in (("a", 100.0, 102.5), ("b", 200.0, 201.0), ("c", 300.0, 309.0)):
        o.saw(run, "Placed", "SCHEDULED", placed, "n1")
        o.saw(run, "Pending", "PENDING", placed + 0.5, "n1")  # seen between: not the end of the start
        o.saw(run, "Running", "RUNNING", running, "n1")
        o.saw(run, "Running", "RUNNING", running + 60, "n1")  # seen again: counted once
    assert o.start_s("n1") == 2.5 and o.start_s("n2") == 0.0
    for run, seconds in (("d", 1.0), ("e", 1.5)):  # the oldest (2.5) leaves the window of 3
        o.saw(run, "Placed", "SCHEDULED", 0.0, "n1")
        o.saw(run, "Running", "RUNNING", seconds, "n1")
    assert sorted(o.starts["n1"]) == [1.0, 1.5, 9.0] and o.start_s("n1") == 1.5


def test_a_placement_undone_or_a_run_started_by_hand_is_no_measurement():
    o = Overheads()
    o.saw("a", "Placed", "SCHEDULED", 100.0, "n1")
    o.saw("a", "Queued", "SCHEDULED", 150.0, None)  # queued again before it ran
    o.saw("a", "Running", "RUNNING", 400.0, "n1")
    o.saw("b", "Running", "RUNNING", 400.0, "n1")  # never seen Placed
    o.saw("c", "Placed", "SCHEDULED", 0.0, "n1")
    o.saw("c", "Running", "RUNNING", MAX_S + 1, "n1")  # held back for hours: not a start latency
    o.saw("d", "Placed", "SCHEDULED", 0.0, "n1")
    o.saw("d", "Cancelled", "CANCELLED", 5.0, "n1")
    assert o.starts == {} and o.placed_at == {}


def test_the_return_is_the_end_less_the_work_ended_tag_of_the_same_attempt():
    end = datetime(2026, 12, 3, 18, 42, 0, tzinfo=timezone.utc)
    tags = ["e31-staged", f"{WORK_ENDED}1:2026-12-03T18:40:00Z", f"{WORK_ENDED}2:2026-12-03T18:41:37Z"]
    assert return_seconds(tags, 2, end, WORK_ENDED) == 23.0
    assert return_seconds(tags, 1, end, WORK_ENDED) == 120.0
    assert return_seconds(tags, 3, end, WORK_ENDED) is None
    assert return_seconds([f"{WORK_ENDED}1:garbage"], 1, end, WORK_ENDED) is None
    assert return_seconds(tags, 2, None, WORK_ENDED) is None
    o = Overheads()
    for seconds in (4.0, 30.0, 5.0, -2.0):
        o.returned("retrain", seconds)
    assert o.output_s("retrain") == 5.0 and o.output_s("other") == 0.0
