"""Deadlines relative to each run's scheduled start, for scheduled jobs."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from e31.flows.compile import compile_plan, resolve_deadline
from e31.flows.job import run_job
from e31.specs import SpecError, parse_spec

HERE = Path(__file__).resolve().parent
UTC = timezone.utc


def _spec(**request) -> dict:
    return {"name": "d", "work": {"kind": "simulation", "entrypoint": "stopwork:steps", "params": {"step_s": 0.1}},
            "request": {"limit": "1h", **request}, "output": {"kind": "results", "url": "/tmp/e31-d", "files": ["done.txt"]}}


@pytest.mark.parametrize("start, expected", [
    (datetime(2027, 3, 27, 23, 0, tzinfo=UTC), datetime(2027, 3, 28, 5, 0, tzinfo=UTC)),   # BST begins that night
    (datetime(2026, 10, 25, 5, 30, tzinfo=UTC), datetime(2026, 10, 25, 6, 0, tzinfo=UTC)),  # GMT again
    (datetime(2026, 10, 24, 5, 30, tzinfo=UTC), datetime(2026, 10, 25, 6, 0, tzinfo=UTC)),  # 06:30 BST: tomorrow
    (datetime(2026, 7, 1, 5, 0, tzinfo=UTC), datetime(2026, 7, 1, 5, 0, tzinfo=UTC)),       # exactly 06:00 BST
])
def test_deadline_at_is_the_next_wall_clock_time_after_the_scheduled_start(start, expected):
    deadline, kind = resolve_deadline(parse_spec(_spec(deadline_at="06:00 Europe/London")), start)
    assert deadline == expected and kind == "06:00 Europe/London, the next after the scheduled start"


def test_deadline_within_counts_from_the_scheduled_start():
    start = datetime(2026, 12, 1, 2, 0, tzinfo=UTC)
    plan = compile_plan(parse_spec(_spec(deadline_within="4h")), start=start)
    assert plan.deadline == datetime(2026, 12, 1, 6, 0, tzinfo=UTC)
    assert plan.stop_at(start.timestamp()) == (start.timestamp() + 3600, "time_limit")
    plan = compile_plan(parse_spec(_spec(deadline_within="20m")), start=start)
    assert plan.stop_at(start.timestamp()) == (start.timestamp() + 1200 - 30, "deadline")


@pytest.mark.parametrize("request_part, line", [
    ({"deadline_within": "4h", "deadline_at": "06:00 UTC"},
     "request.deadline_at: give one kind of deadline (got deadline_within and deadline_at); "
     "keep one of deadline, deadline_within, deadline_at"),
    ({"deadline_at": "06:00 Mars/Olympus"},
     "request.deadline_at: 'Mars/Olympus' is not a known IANA timezone (got '06:00 Mars/Olympus'); "
     'write a 24-hour time and an IANA timezone, e.g. "06:00 Europe/London"'),
    ({"deadline_at": "6am Europe/London"},
     "request.deadline_at: '6am' is not a time of day (HH:MM) (got '6am Europe/London'); "
     'write a 24-hour time and an IANA timezone, e.g. "06:00 Europe/London"'),
])
def test_bad_relative_deadlines_are_refused(request_part, line):
    with pytest.raises(SpecError) as err:
        parse_spec(_spec(**request_part))
    assert str(err.value).splitlines()[1:] == [f"  {line}"]


def test_compile_shows_the_resolved_deadline_for_the_next_run(e31):
    result = e31("compile", str(HERE.parents[1] / "specs/examples/digits-nightly-retrain.yaml"),
                 "--set", "request.deadline_at=06:00 Europe/London")
    assert result.returncode == 0, result.stderr
    (line,) = [l for l in result.stdout.splitlines() if l.startswith("    deadline ")]
    match = re.fullmatch(r"    deadline (\S+) \(06:00 Europe/London, the next after the scheduled start; return reserve 30s\)", line)
    resolved = datetime.fromisoformat(match.group(1))
    now = datetime.now(UTC)
    assert now < resolved <= now + timedelta(days=1) and resolved.astimezone(ZoneInfo("Europe/London")).hour == 6


def test_a_run_stops_at_its_relative_deadline(prefect_api, scratch, tmp_path, monkeypatch):
    monkeypatch.setenv("E31_RETURN_RESERVE_S", "2")
    raw = _spec(deadline_within="12s", grace="2s")
    raw["output"]["url"] = str(tmp_path / "out")
    manifest = run_job(parse_spec(raw), code_dir=str(HERE))
    assert (manifest["status"], manifest["reason"]) == ("partial", "deadline")
    assert manifest["step"] >= 1
