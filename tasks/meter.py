"""The meter: what a run is billed, in one place (docs/output.md, "The meter")."""

from __future__ import annotations

from typing import Any


def meter(gpus: int, cpus: int, work_started_at: float | None, released_at: float) -> dict[str, Any]:
    """The manifest's ``meter``: the request's GPUs and CPUs times the
    seconds from the work's start to the release.

    ``work_started_at`` (Unix seconds): when the work started -- a Python
    entrypoint's function was called (after its child's own imports: the
    interpreter, E31, the entrypoint's module), or a ``command`` was
    exec'd; None when no work started (the run stopped or failed before
    it), which bills nothing.  ``released_at`` (Unix seconds): the release,
    when the output is returned (its manifest written), or when the run's
    process gave up returning it (a return finished later from scratch).
    Staging (in the run or before it), a wait behind the job ahead on
    the node and the child's start are not billed.

    Returns ``{"started_at", "released_at"}`` (Unix seconds, None when no
    work started), ``seconds`` (the metered wall time, >= 0),
    ``gpu_seconds`` = gpus x seconds and ``cpu_seconds`` = cpus x seconds,
    each rounded to milliseconds (``seconds`` from the rounded ends).
    """
    if work_started_at is None:
        start = end = None
        seconds = 0.0
    else:  # seconds from the rounded ends, so that seconds == round(released_at - started_at, 3) as shown
        start, end = round(work_started_at, 3), round(released_at, 3)
        seconds = round(max(0.0, end - start), 3)
    return {
        "started_at": start,
        "released_at": end,
        "seconds": seconds,
        "gpu_seconds": round(gpus * seconds, 3),
        "cpu_seconds": round(cpus * seconds, 3),
    }
