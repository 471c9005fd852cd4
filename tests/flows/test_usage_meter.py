"""The meter added up (e31.flows.queue.meter): rows by tenant, job and day from the attempts' manifests."""

from __future__ import annotations

import pytest

from e31.flows.queue.meter import Attempt, RunBill, usage_rows

T0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC


def test_rows_sum_the_attempts_released_in_the_period_and_count_runs_by_their_newest_manifest():
    preempted = Attempt("partial", T0 + 10, T0 + 3610, 7200.0, 3600.0, lost_s=120.0)
    resumed = Attempt("completed", T0 + 4000, T0 + 7600, 7200.0, 3600.0, lost_s=120.0)
    runs = [
        RunBill("r1", "train", "vision", T0, 2, True, (preempted, resumed)),
        RunBill("r2", "sweep", "nlp", T0 + 100, 1, True, (Attempt("failed", T0 + 200, T0 + 2000, 1800.0, 1800.0),)),
        RunBill("r3", "sweep", "nlp", T0 + 300, 1, False, ()),  # running: billed once it returns
        RunBill("r4", "sweep", "nlp", T0 + 400, 1, False, (), waiting=True),  # queued: holds nothing
        RunBill("r5", "train", "vision", T0 + 500, 2, False,  # preempted once, queued again: its attempt billed
                (Attempt("partial", T0 + 600, T0 + 1600, 2000.0, 1000.0),), waiting=True),
        RunBill("old", "train", "vision", T0 - 90_000, 2, True, (Attempt("completed", T0 - 89_000, T0 - 86_500,
                                                                         5000.0, 2500.0),)),
    ]
    by_tenant = {r.key: r.as_dict() for r in usage_rows(runs, since=T0 - 3600)}
    assert by_tenant == {
        "nlp": {"key": "nlp", "gpu_seconds": 1800.0, "cpu_seconds": 1800.0, "gpu_hours": 0.5, "cpu_hours": 0.5, "redone_gpu_hours": 0.0, "completed": 0,
                "partial": 0, "failed": 1, "running": 1, "queued": 1, "mean_wait_s": 100.0},
        "vision": {"key": "vision", "gpu_seconds": 16400.0, "cpu_seconds": 8200.0, "gpu_hours": round(16400 / 3600, 6),
                   "cpu_hours": round(8200 / 3600, 6), "redone_gpu_hours": round(120 * 2 / 3600, 6),
                   "completed": 1, "partial": 0, "failed": 0, "running": 0, "queued": 1, "mean_wait_s": 55.0},
    }
    by_day = {r.key: (r.gpu_hours, r.completed) for r in usage_rows(runs, since=T0 - 2 * 86400, by="day")}
    assert by_day == {"2025-12-30": (5000 / 3600, 1), "2026-01-01": ((16200 + 2000) / 3600, 1)}  # 23:58 on the 30th
    assert [r.key for r in usage_rows(runs, since=T0 - 3600, by="job")] == ["sweep", "train"]
    assert usage_rows([], since=T0) == []
    with pytest.raises(ValueError, match="by must be one of tenant, job, day"):
        usage_rows(runs, since=T0, by="week")


def test_a_run_that_failed_before_any_attempt_returned_counts_as_failed_and_bills_nothing():
    """A run refused at its start (or whose input did not verify) ends Failed with no manifest
    artifact: it counts as failed, on the day it ended, with nothing billed and no wait (no work
    started); one that ended before the period, or was cancelled while queued, counts nowhere."""
    runs = [RunBill("r1", "refused", "vision", T0, 2, True, (), failed_at=T0 + 30),
            RunBill("r2", "old", "vision", T0 - 90_000, 2, True, (), failed_at=T0 - 89_000),
            RunBill("r3", "cancelled", "vision", T0, 2, True, ())]
    assert [r.as_dict() for r in usage_rows(runs, since=T0 - 3600)] == [
        {"key": "vision", "gpu_seconds": 0.0, "cpu_seconds": 0.0, "gpu_hours": 0.0, "cpu_hours": 0.0,
         "redone_gpu_hours": 0.0, "completed": 0, "partial": 0, "failed": 1, "running": 0, "queued": 0,
         "mean_wait_s": None}]
    assert [(r.key, r.failed) for r in usage_rows(runs, since=T0 - 3600, by="day")] == [("2026-01-01", 1)]


def test_a_run_whose_newest_attempt_stopped_before_its_work_counts_by_that_manifest():
    """A resumed run stopped at a gate before its work (a missed deadline, a cancel) publishes a manifest with
    no meter times: the run counts as partial on that manifest's day, with the redone GPU-hours of its
    newest manifest (it was left out: no time to count it at)."""
    first = Attempt("partial", T0 + 10, T0 + 1010, 2000.0, 1000.0, lost_s=300.0, published_at=T0 + 1011)
    gated = Attempt("partial", None, None, 0.0, 0.0, lost_s=300.0, published_at=T0 + 5000)
    rows = usage_rows([RunBill("r1", "train", "vision", T0, 2, True, (first, gated))], since=T0 - 3600)
    assert [(r.key, r.gpu_seconds, r.partial, r.completed, r.redone_gpu_hours, r.mean_wait_s) for r in rows] == [
        ("vision", 2000.0, 1, 0, 300 * 2 / 3600, 10.0)]
    assert gated.at == T0 + 5000 and first.at == T0 + 1010


def test_a_run_that_ended_failed_counts_as_failed_on_its_end_whatever_its_newest_manifest_says():
    """A run preempted (a partial manifest) that then failed for good counted as partial, or nowhere when that
    manifest was older than the period; a waiting run got a row for a day before the period (found by an
    attack)."""
    partial = Attempt("partial", T0 - 7200, T0 - 3700, 3500.0, 3500.0, lost_s=60.0)
    runs = [RunBill("r1", "train", "vision", T0 - 8000, 1, True, (partial,), failed_at=T0 + 100),
            RunBill("r2", "train", "vision", T0 - 86_400 * 3, 1, False, (), waiting=True)]
    rows = usage_rows(runs, since=T0 - 3600)
    assert [(r.key, r.gpu_seconds, r.failed, r.partial, r.queued, r.redone_gpu_hours) for r in rows] == [
        ("vision", 0.0, 1, 0, 1, 60 / 3600)]
    assert [(r.key, r.failed, r.queued) for r in usage_rows(runs, since=T0 - 3600, by="day")] == [
        ("2025-12-31", 0, 1), ("2026-01-01", 1, 0)]
