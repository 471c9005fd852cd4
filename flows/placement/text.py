"""How the planner says times, durations and sizes in its one-line reasons."""

from __future__ import annotations

from datetime import datetime, timezone

from .model import QueuedJob

__all__ = ["clock", "gib", "run_time", "span", "where"]

_SOURCE = {"duration": "duration", "history": "past runs", "limit": "limit"}


def clock(t: float, now: float) -> str:
    """A Unix time as UTC wall-clock text: ``02:40 UTC`` on ``now``'s date, else with the date
    (``2026-05-02 02:40 UTC``); seconds are shown only when they are not zero."""
    t = round(t)
    fmt = "%H:%M:%S UTC" if t % 60 else "%H:%M UTC"
    if t // 86400 != round(now) // 86400:
        fmt = "%Y-%m-%d " + fmt
    return datetime.fromtimestamp(t, timezone.utc).strftime(fmt)


def where(node: str | None, devices: tuple[int, ...], gang: tuple = ()) -> tuple[str, str]:
    """``(nodes, devices)`` as the NODE and GPUS columns say them: ``n1`` and ``0,1``; for a multi-node job
    (``gang``: ``((node, devices), ...)`` of its other nodes) every node, its first first, joined by ``+``
    (``n1+n2``, ``0,1+0,1``); ``-`` for none."""
    parts = ((node, tuple(devices)), *gang) if node else ()
    if not parts:
        return "-", ",".join(map(str, devices)) or "-"
    if len(parts) == 1:
        return str(node), ",".join(map(str, devices)) or "-"
    return "+".join(str(n) for n, _ in parts), "+".join(",".join(map(str, d)) or "-" for _, d in parts)


def span(seconds: float) -> str:
    """Seconds as ``1h30m``, ``45s``, ``2d3h`` (whole seconds; the form job specs accept)."""
    left, parts = round(seconds), []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, left = divmod(left, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"


def gib(nbytes: int) -> str:
    """Bytes as ``32 GiB`` / ``1.5 GiB`` / ``512 MiB``."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.0f} {unit}" if value == int(value) or value >= 100 else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def run_time(job: QueuedJob) -> str:
    """The planning run time and where it came from: ``run time 2h: duration``, with the job's
    start, staging and return when they take a second or more (``+ start 1m + return 4m``)."""
    extra = "".join(f" + {what} {span(seconds)}" for what, seconds in
                    (("start", job.start_s), ("staging", job.staging_s), ("return", job.output_s)) if seconds >= 1)
    return f"run time {span(job.runtime_s)}: {job.runtime_note or _SOURCE[job.runtime_source]}{extra}"
