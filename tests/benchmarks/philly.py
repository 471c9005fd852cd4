"""A replay of Microsoft's Philly GPU-cluster trace (2017), for ``bench_attained.py --model philly``.

The trace: Jeon et al., "Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN Training
Workloads", USENIX ATC 2019, published at https://github.com/msr-fiddle/philly-traces (a Git LFS
archive).  This replay reads the per-job summary of it that the Pollux artifact ships (Qiao et al.,
OSDI 2021): https://github.com/petuum/adaptdl, commit ``de25dcc9``, file
``simulator/traces/philly.csv`` (3.4 MB, sha256 ``ebffb3dd...53da``: :data:`SHA256`), one row per job:
``timestamp`` (submission, UTC), ``duration`` (run seconds), ``num_gpus``, ``gpu_time``, ``cluster``
(the virtual cluster, a team).  82,247 jobs submitted from 2017-09-04 to 2017-12-22; 81,958 of them ask
for at most 8 GPUs.  The file is not part of this repository: pass its path with ``--trace``.

What the replay keeps of each job is what the trace says: its submission time, its GPUs and its run
time.  What it adds: every job is single-node (jobs over ``max_gpus`` GPUs are left out and counted),
asks for 4 CPUs and 32 GiB of memory per GPU (the trace has neither), and a run shorter than 30 s is
counted as 30 s (the restart cost of a preempted job is of that order).  The pool's size is chosen
so that the window of jobs offers the asked load (:func:`nodes_for_load`).
"""

from __future__ import annotations

import csv
import hashlib
import math
from datetime import datetime, timezone
from pathlib import Path

SHA256 = "ebffb3dd1589bdf4e7bcd74496201c5ded1d557d498ee14f560463f37ec353da"
MIN_RUN_S = 30.0


def digest(path: Path) -> str:
    """The file's sha256 in hex, to say which copy of the trace a replay read."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def jobs(path: Path, count: int, skip: int = 0, max_gpus: int = 8) -> tuple[list[tuple[float, int, float, str]], int]:
    """The trace's jobs ``skip`` to ``skip + count`` by submission time, as ``(submitted, gpus,
    run_s, cluster)`` with ``submitted`` in POSIX seconds, and how many jobs of that window ask for
    more than ``max_gpus`` GPUs (left out).

    Raises ``ValueError`` naming the line of a row that cannot be read.
    """
    rows = []
    with path.open(newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            try:
                at = datetime.fromisoformat(row["timestamp"]).replace(tzinfo=timezone.utc).timestamp()
                rows.append((at, int(row["num_gpus"]), max(float(row["duration"]), MIN_RUN_S), row["cluster"]))
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}: line {line}: not a Philly job row ({e})") from None
    rows.sort(key=lambda r: r[0])
    window = rows[skip:skip + count]
    kept = [r for r in window if 1 <= r[1] <= max_gpus]
    return kept, len(window) - len(kept)


def nodes_for_load(window: list[tuple[float, int, float, str]], load: float, gpus_per_node: int = 8) -> int:
    """The number of nodes of ``gpus_per_node`` GPUs on which ``window`` offers ``load``: the GPU-seconds
    its jobs ask for between the first submission and the last (a job's run counted up to the last
    submission: the trace's runs of weeks would otherwise size the pool for work that falls after the
    window), over that span times the pool's GPUs."""
    first, last = min(r[0] for r in window), max(r[0] for r in window)
    work = sum(g * min(run, last - at) for at, g, run, _ in window)
    return max(1, math.ceil(work / (max(last - first, 1.0) * gpus_per_node * load)))
