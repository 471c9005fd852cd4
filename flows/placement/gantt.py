"""A Gantt chart of a plan as a PNG (matplotlib, Agg backend: no display needed).

One row per GPU device (``node/device``) when the pool has at most 64 of them, else one row per
node; each started or waiting job is a bar labelled with its id over the rows it holds; a job's
deadline is a red tick at the end of its row, and no job's bar is red.  Jobs that share a node
row at once (CPU jobs; every job when rows are nodes) get lanes of their own within it, so
neither bars nor labels overlap.  The time axis is hours from ``now``.
"""

from __future__ import annotations

from dataclasses import replace

import os
import zlib
from collections.abc import Sequence

from .model import Node, Placement, QueuedJob
from .text import clock

__all__ = ["MAX_DEVICE_ROWS", "gantt_png"]

#: Above this many GPU devices the chart has one row per node.
MAX_DEVICE_ROWS = 64
#: The colours of tab20 that bars may take: its two reds (6, 7) are kept for deadlines.
_PALETTE = tuple(k for k in range(20) if k not in (6, 7))


def _lanes(spans: Sequence[tuple[float, float, str]]) -> tuple[dict[str, int], int]:
    """Lanes for bars that share one row: ``spans`` are (start, end, job); each job gets the lowest
    lane free at its start (interval partitioning).  Returns job -> lane and the number of lanes."""
    ends: list[float] = []
    lane: dict[str, int] = {}
    for start, end, job in sorted(spans):
        k = next((k for k, e in enumerate(ends) if e <= start), len(ends))
        if k == len(ends):
            ends.append(end)
        else:
            ends[k] = end
        lane[job] = k
    return lane, max(len(ends), 1)


def _rows(nodes: Sequence[Node]) -> tuple[list[str], dict[tuple[str, int | None], int]]:
    by_device = 0 < sum(n.gpus for n in nodes) <= MAX_DEVICE_ROWS
    labels, where = [], {}
    for node in nodes:
        if by_device and node.gpus:
            for d in range(node.gpus):
                where[(node.name, d)] = len(labels)
                labels.append(f"{node.name}/{d}")
        else:
            where[(node.name, None)] = len(labels)
            labels.append(node.name)
    return labels, where


def gantt_png(path: str | os.PathLike[str], nodes: Sequence[Node], placements: Sequence[Placement],
              jobs: Sequence[QueuedJob], now: float) -> None:
    """Write the chart of ``placements`` (refusals are left out) to ``path``.

    Raises:
        OSError: the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, where = _rows(nodes)
    deadlines = {j.id: j.deadline for j in jobs}
    # a multi-node job is drawn on every node it holds
    shown = [replace(p, node=node, devices=devices, gang=()) for p in placements if p.action != "refuse"
             for node, devices in ((p.node, p.devices), *p.gang)]
    height = max(2.0, 0.3 * len(labels) + 1.2)
    fig, ax = plt.subplots(figsize=(11, height))
    shared: dict[int, list[tuple[float, float, str]]] = {}  # node row -> the jobs drawn on it
    for p in shown:
        if not any((p.node, d) in where for d in p.devices):
            shared.setdefault(where[(p.node, None)], []).append((p.start, p.end, p.job))
    lanes = {row: _lanes(spans) for row, spans in shared.items()}
    try:
        for p in shown:
            rows = [where[(p.node, d)] for d in p.devices if (p.node, d) in where] or [where[(p.node, None)]]
            left, width = (p.start - now) / 3600, (p.end - p.start) / 3600
            colour = plt.cm.tab20(_PALETTE[zlib.crc32(p.job.encode()) % len(_PALETTE)])
            height, offset = 0.8, 0.0
            if len(rows) == 1 and rows[0] in lanes:
                lane, count = lanes[rows[0]][0][p.job], lanes[rows[0]][1]
                height = 0.8 / count
                offset = -0.4 + height * (lane + 0.5)
            for row in sorted(set(rows)):
                ax.barh(row + offset, width, left=left, height=height, color=colour, edgecolor="black",
                        linewidth=0.5, hatch=None if p.action == "start" else "//")
            middle = sorted(set(rows))[len(set(rows)) // 2] + offset
            ax.text(left + width / 2, middle, p.job, ha="center", va="center", fontsize=7 if height >= 0.4 else 5,
                    clip_on=True)
            deadline = deadlines.get(p.job)
            if deadline is not None:
                for row in set(rows):
                    ax.plot([(deadline - now) / 3600] * 2, [row - 0.45, row + 0.45], color="red", linewidth=2)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(left=0)
        ax.set_xlabel(f"hours from {clock(now, now)} (hatched: waiting; red: deadline)")
        ax.grid(axis="x", linestyle=":", linewidth=0.5)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
