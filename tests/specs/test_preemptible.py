"""Issue 36 item 1: the declaration of preemption -- ``request.preemptible`` (its default from the
job's checkpoints and deadline), the note ``e31 validate`` prints, and the pool's ``preemption:``
options -- with the exact error lines for bad input."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from e31.specs import SpecError, load_pool, load_spec
from e31.specs.preemption import checkpoints_declared, is_preemptible, preemption_notes

NOTE = ("request.preemptible: the job declares no checkpoints, so each preemption loses all its work so far; "
        "add output.checkpoint.every (e.g. 10m) and save checkpoints in the work")


def spec_file(tmp_path: Path, request: str, checkpoint: str = "") -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: j\nwork: {kind: simulation, command: [echo]}\n"
        f"request: {{limit: 1h, {request}}}\n"
        f"output: {{kind: files, url: {tmp_path / 'out'}, files: [a]{checkpoint}}}\n", encoding="utf-8")
    return path


EVERY = ", checkpoint: {every: 10m}"
STEPS = ", checkpoint: {every_steps: 100}"


@pytest.mark.parametrize(("request_", "checkpoint", "expected"), [
    ("cpus: 1", EVERY, True),  # checkpoints, no deadline: preemptible by default
    ("cpus: 1", STEPS, True),
    ("cpus: 1", "", False),  # no checkpoints: a preemption would lose everything
    ("deadline_within: 4h", EVERY, False),  # a deadline is at stake
    ("deadline_at: '06:00 UTC'", EVERY, False),
    ("deadline: '2099-01-01T00:00:00+00:00'", EVERY, False),
    ("preemptible: true", "", True),  # an explicit value wins
    ("preemptible: false", EVERY, False),
    ("preemptible: true, deadline_within: 4h", EVERY, True),
])
def test_the_default_follows_checkpoints_and_deadline_and_an_explicit_value_wins(tmp_path, request_, checkpoint,
                                                                                expected):
    spec = load_spec(spec_file(tmp_path, request_, checkpoint))
    assert is_preemptible(spec) is expected
    assert checkpoints_declared(spec) is bool(checkpoint)


def test_a_preemptible_job_without_checkpoints_gets_a_note_from_validate(tmp_path):
    bare = load_spec(spec_file(tmp_path, "preemptible: true"))
    assert preemption_notes(bare) == [NOTE]
    assert preemption_notes(load_spec(spec_file(tmp_path, "preemptible: true", EVERY))) == []
    assert preemption_notes(load_spec(spec_file(tmp_path, "cpus: 1"))) == []  # not preemptible: nothing to say
    out = subprocess.run([str(Path(sys.executable).with_name("e31")), "validate", str(spec_file(tmp_path, "preemptible: true"))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1:] == [f"note: {NOTE}"]


def test_a_deadline_job_made_preemptible_by_hand_gets_a_note(tmp_path):
    spec = load_spec(spec_file(tmp_path, "preemptible: true, deadline_within: 4h", EVERY))
    assert preemption_notes(spec) == [
        "request.preemptible: true on a job with a deadline: the queue may preempt it, and the time it waits to "
        "run again counts towards its deadline; drop request.preemptible (a deadline job is not preemptible by "
        "default) to keep it running"]


def test_preemptible_must_be_a_boolean(tmp_path):
    path = spec_file(tmp_path, "preemptible: maybe")
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(err.value) == (f"invalid job spec {path} (1 problem)\n"
                              "  request.preemptible: must be true or false (got 'maybe')")


def pool_file(tmp_path: Path, preemption: str = "") -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text("nodes: [{name: g, gpus: 8, cpus: 64, memory: 512GiB}]\n" + preemption, encoding="utf-8")
    return path


def test_the_pool_preemption_options_and_their_defaults(tmp_path):
    default = load_pool(pool_file(tmp_path)).preemption
    assert (default.min_run, default.attained_min_run, default.max_per_day) == (
        timedelta(minutes=10), timedelta(hours=1), None)
    given = load_pool(pool_file(tmp_path, "preemption: {min_run: 30m, attained_min_run: 2h, max_per_day: 4}\n")).preemption
    assert (given.min_run, given.attained_min_run, given.max_per_day) == (timedelta(minutes=30), timedelta(hours=2), 4)
    none = load_pool(pool_file(tmp_path, "preemption: {min_run: 0s, max_per_day: 0}\n")).preemption
    assert (none.min_run, none.max_per_day) == (timedelta(0), 0)  # no minimum run; never preempts


def test_bad_pool_preemption_options_are_refused_with_every_problem(tmp_path):
    path = pool_file(tmp_path, "preemption: {min_run: -5m, max_per_day: -1, every: 3}\n")
    with pytest.raises(SpecError) as err:
        load_pool(path)
    assert str(err.value) == (
        f"invalid pool {path} (3 problems)\n"
        "  preemption.min_run: must not be negative (got '-5m')\n"
        "  preemption.max_per_day: must be >= 0 (got -1)\n"
        "  preemption.every: unknown field; allowed fields: min_run, attained_min_run, max_per_day")
