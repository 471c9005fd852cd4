"""The ``job-spec`` artifact (the spec on the flow run's page) shows memory
as a person writes it, not in bytes."""

from __future__ import annotations

import pytest

from e31.flows.compile import compile_plan, describe_markdown
from e31.specs import parse_spec
from e31.specs.units import format_memory, parse_memory


@pytest.mark.parametrize(("written", "shown"), [
    ("4GiB", "4GiB"), ("512MB", "512MB"), ("1.5GB", "1.5GB"), ("1536MiB", "1.5GiB"), ("100KiB", "100KiB"),
    (1234567891, "~1.15GiB (1234567891 bytes)"), (999, "999B"), ("3TiB", "3TiB"),
])
def test_memory_is_shown_in_units(written, shown):
    assert format_memory(parse_memory(written)) == shown
    if not shown.startswith("~"):
        assert parse_memory(shown) == parse_memory(written)  # the text reads back as the same bytes


def test_the_job_spec_artifact_shows_memory_as_written(tmp_path):
    spec = parse_spec({"name": "j", "work": {"kind": "processing", "command": ["echo"]},
                       "request": {"cpus": 2, "memory": "16GiB", "limit": "30m"},
                       "output": {"kind": "results", "url": str(tmp_path / "out") + "/", "files": ["x.txt"]}})
    text = describe_markdown(spec, compile_plan(spec, scratch_root=tmp_path / "scratch"))
    assert "**request**: 0 gpu, 2 cpu, memory 16GiB, duration -, limit 0:30:00, " in text
    assert "17179869184" not in text
