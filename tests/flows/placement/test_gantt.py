"""The Gantt chart of ``e31 plan --png``: lanes for jobs sharing a node row, no bar in deadline red."""

from __future__ import annotations

import matplotlib

from e31.flows.placement import Node, plan
from e31.flows.placement.gantt import _PALETTE, _lanes, gantt_png
from tests.flows.placement.helpers import GIB, T0, queued

matplotlib.use("Agg")


def test_jobs_sharing_a_row_get_lanes_of_their_own():
    lane, count = _lanes([(0, 10, "a"), (5, 15, "b"), (10, 20, "c"), (16, 30, "d")])
    assert (lane, count) == ({"a": 0, "b": 1, "c": 0, "d": 1}, 2)
    assert _lanes([]) == ({}, 1)


def test_no_bar_takes_the_deadline_red(tmp_path, monkeypatch):
    import matplotlib.axes

    assert 6 not in _PALETTE and 7 not in _PALETTE and len(_PALETTE) == 18
    bars = []
    real = matplotlib.axes.Axes.barh

    def record(self, y, width, *args, **kwargs):
        bars.append((round(y, 3), kwargs["height"], kwargs["color"]))
        return real(self, y, width, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "barh", record)
    nodes = [Node("c1", 0, 8, 8 * GIB)]
    jobs = [queued(f"job-{k}", 0, 1 + k, cpus=2, deadline_h=20) for k in range(3)]
    placements = plan(nodes, [], jobs, T0)
    assert [p.action for p in placements] == ["start"] * 3
    gantt_png(tmp_path / "plan.png", nodes, placements, jobs, T0)
    reds = {matplotlib.colormaps["tab20"](6), matplotlib.colormaps["tab20"](7)}
    assert not any(colour in reds for _, _, colour in bars)
    # three jobs at once on the one CPU row: three lanes of a third of the row each, none overlapping
    assert sorted((y, round(h, 3)) for y, h, _ in bars) == [(-0.267, 0.267), (0.0, 0.267), (0.267, 0.267)]
