"""The runtime a plan assumes for a job: its ``duration``; else its own history; else its ``limit``.

A job that does not know its size in advance still gets a fair plan once it
has run a few times: the estimate is a high percentile (the 90th by default,
nearest-rank method) of the run times of its most recent completed runs (the
``timings.run_s`` of its manifests), never more than its limit, and the reason
shows it as such (``run time 1h12m: p90 of 14 past runs``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .model import RuntimeSource

__all__ = ["Estimate", "estimate_runtime", "percentile", "run_times"]

#: How many of the most recent runs the history estimate looks at.
RECENT = 20


@dataclass(frozen=True)
class Estimate:
    """A planning runtime in seconds, where it came from, and how to say so in a reason."""

    runtime_s: float
    source: RuntimeSource
    note: str


def percentile(values: Sequence[float], pct: float) -> float:
    """The nearest-rank ``pct``-th percentile (0 < pct <= 100) of non-empty ``values``.

    Raises:
        ValueError: ``values`` is empty or ``pct`` is outside (0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 < pct <= 100:
        raise ValueError(f"percentile must be in (0, 100] (got {pct})")
    ordered = sorted(values)
    return ordered[max(math.ceil(pct / 100 * len(ordered)), 1) - 1]


def estimate_runtime(duration_s: float | None, limit_s: float | None, history_s: Sequence[float] = (),
                     pct: float = 90, recent: int = RECENT) -> Estimate:
    """The runtime to plan with, in seconds.

    ``duration_s``: the declared expected run time; ``limit_s``: the hard stop;
    ``history_s``: run times of the job's past completed runs, oldest first (the last
    ``recent`` are used).  A spec always has a duration or a limit.

    Raises:
        ValueError: neither ``duration_s`` nor ``limit_s`` is given.
    """
    if duration_s is not None:
        return Estimate(float(duration_s), "duration", "duration")
    past = [float(s) for s in history_s if s is not None and s >= 0][-recent:]
    if past:
        value = percentile(past, pct)
        capped = limit_s is not None and value > limit_s
        value = float(limit_s) if capped else value
        label = "90th percentile" if pct == 90 else f"{pct:g}th percentile"
        note = f"{label} of {len(past)} past run{'s' if len(past) != 1 else ''}" + (", capped at the limit" if capped else "")
        return Estimate(value, "history", note)
    if limit_s is None:
        raise ValueError("a job needs a duration or a limit to be planned")
    return Estimate(float(limit_s), "limit", "limit")


def run_times(manifests: Iterable[Mapping[str, Any]], name: str) -> list[float]:
    """``timings.run_s`` of the completed runs of job ``name`` among manifest dicts (manifest.json),
    oldest first by ``finished_at``; others and malformed ones are skipped."""
    found = []
    for m in manifests:
        if not isinstance(m, Mapping):
            continue
        timings = m.get("timings")
        run_s = timings.get("run_s") if isinstance(timings, Mapping) else None
        if m.get("job") == name and m.get("status") == "completed" and isinstance(run_s, (int, float)):
            found.append((str(m.get("finished_at") or ""), float(run_s)))
    return [run_s for _, run_s in sorted(found, key=lambda pair: pair[0])]
