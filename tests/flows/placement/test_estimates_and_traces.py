"""Runtime estimates (duration, history, limit) and reading SWF traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from e31.flows.placement.estimates import Estimate, estimate_runtime, percentile, run_times
from e31.flows.placement.swf import SwfError, read_swf

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize(("values", "pct", "expected"), [
    ([5.0], 90, 5.0),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90, 9),  # nearest rank: ceil(0.9 * 10) = 9th
    ([10, 1, 7, 3], 50, 3),
    ([10, 1, 7, 3], 100, 10),
])
def test_percentile_is_nearest_rank(values, pct, expected):
    assert percentile(values, pct) == expected


def test_percentile_refuses_nonsense():
    with pytest.raises(ValueError, match="percentile of no values"):
        percentile([], 90)
    with pytest.raises(ValueError, match=r"must be in \(0, 100\] \(got 0\)"):
        percentile([1.0], 0)


@pytest.mark.parametrize(("duration", "limit", "history", "expected"), [
    (600, 3600, [100, 200], Estimate(600.0, "duration", "duration")),
    (None, 3600, [60.0 * k for k in range(1, 15)], Estimate(780.0, "history", "90th percentile of 14 past runs")),
    (None, 3600, [5000.0], Estimate(3600.0, "history", "90th percentile of 1 past run, capped at the limit")),
    (None, 3600, [], Estimate(3600.0, "limit", "limit")),
    (None, 3600, list(range(100)), Estimate(97.0, "history", "90th percentile of 20 past runs")),  # the last 20
])
def test_estimate_prefers_duration_then_history_then_limit(duration, limit, history, expected):
    assert estimate_runtime(duration, limit, history) == expected


def test_estimate_needs_duration_or_limit():
    with pytest.raises(ValueError, match="needs a duration or a limit"):
        estimate_runtime(None, None)


def test_run_times_reads_completed_manifests_of_the_job_oldest_first():
    manifests = [
        {"job": "a", "status": "completed", "timings": {"run_s": 30.0}, "finished_at": "2026-01-02T00:00:00+00:00"},
        {"job": "a", "status": "completed", "timings": {"run_s": 10}, "finished_at": "2026-01-01T00:00:00+00:00"},
        {"job": "a", "status": "failed", "timings": {"run_s": 99.0}, "finished_at": "2026-01-03T00:00:00+00:00"},
        {"job": "b", "status": "completed", "timings": {"run_s": 5.0}},
        {"job": "a", "status": "completed", "timings": "broken"},
        "not a manifest",
    ]
    assert run_times(manifests, "a") == [10.0, 30.0]


def test_read_swf_maps_fields_and_skips_unknown_jobs():
    trace = read_swf(DATA / "small.swf")
    assert trace.start == 1_767_225_600.0 and trace.skipped == 1
    assert [j.id for j in trace.jobs] == ["1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "12", "13"]
    first, twelfth, last = trace.jobs[0], trace.jobs[-2], trace.jobs[-1]
    assert (first.submit, first.runtime_s, first.limit_s, first.procs) == (0.0, 100.0, 200.0, 2)
    assert (twelfth.runtime_s, twelfth.limit_s) == (30.0, 30.0)  # no requested time: its run time
    assert (last.runtime_s, last.limit_s) == (50.0, 50.0)  # ran past its requested time: stopped there
    assert [j.id for j in read_swf(DATA / "small.swf", limit_jobs=2).jobs] == ["1", "2"]


def test_read_swf_names_the_bad_line(tmp_path):
    path = tmp_path / "t.swf"
    path.write_text("; header\n" + " ".join(["1"] * 17 + ["x"]) + "\n", encoding="utf-8")
    with pytest.raises(SwfError) as info:
        read_swf(path)
    assert str(info.value) == (f"{path}:2: field 18 must be a number (got 'x'); an SWF job line has 18 "
                               "whitespace-separated numbers, -1 for unknown")
    with pytest.raises(SwfError, match="cannot read trace .*missing.swf: No such file or directory; check the path"):
        read_swf(tmp_path / "missing.swf")


def test_the_planner_imports_only_the_standard_library():
    import subprocess
    import sys

    code = ("import sys, e31.flows.placement, e31.flows.placement.simulate, e31.flows.placement.swf, "
            "e31.flows.placement.estimates; "
            "print(sorted(m for m in ('prefect', 'fsspec', 'torch', 'pydantic', 'yaml', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
