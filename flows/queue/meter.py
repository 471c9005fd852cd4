"""The meter added up: what each tenant, job or day used of a pool (pure; ``e31 usage`` reads the API).

Every attempt of a flow run returns its output with a manifest whose ``meter`` bills the request's GPUs
and CPUs from the work's start to the release (:mod:`e31.tasks.meter`); the manifest artifact of each
attempt carries it.  A row here sums those meters over the attempts released in the period, so every
figure is a sum of manifests' fields, nothing estimated:

* ``gpu_seconds``, ``cpu_seconds``: the sums of the attempts' ``meter.gpu_seconds`` and
  ``meter.cpu_seconds`` (to the millisecond, as the manifests write them); ``gpu_hours``, ``cpu_hours``:
  the same / 3600;
* ``redone_gpu_hours``: each run's newest manifest's ``lost_s`` (the work its preemptions threw away)
  times its GPUs / 3600: GPU-hours billed twice;
* ``completed``, ``partial``, ``failed``: runs that ended in the period, by their newest manifest's
  status, except that a run that ended ``Failed`` or ``Crashed`` counts as failed on its end (also one
  whose newest manifest is partial, or older than the period, or that never returned one: refused at its
  start, an input that did not verify); ``running``: runs not ended that hold
  compute now (placed, starting or running: billed when their attempt returns); ``queued``: runs not
  ended that wait for compute (queued, or queued again after a preemption or a crash);
* ``mean_wait_s``: over runs whose work has started, from the submission (the flow run's creation; a
  deployment's scheduled run: its scheduled time) to the first attempt's ``meter.started_at``.

An attempt whose work never started (stopped by a cancel or a missed deadline first) bills nothing
and counts at its manifest's publication.

Rows are by tenant (the run's tag), by job name, or by UTC day (of each attempt's release; a run's
counts on the day its newest attempt was released).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone

__all__ = ["Attempt", "BY", "Row", "RunBill", "usage_rows"]

#: What rows can be keyed by.
BY = ("tenant", "job", "day")


@dataclass(frozen=True)
class Attempt:
    """One attempt's manifest fields the meter needs: ``status``, ``started_at`` and ``released_at``
    (Unix seconds; None when no work started), ``gpu_seconds``, ``cpu_seconds``, ``lost_s``; and
    ``published_at`` (Unix seconds the manifest artifact was made: the attempt's time when no work
    started, e.g. one stopped by a cancel or a missed deadline before its work)."""

    status: str
    started_at: float | None
    released_at: float | None
    gpu_seconds: float
    cpu_seconds: float
    lost_s: float = 0.0
    published_at: float | None = None

    @property
    def at(self) -> float | None:
        """When the attempt ended: its release, else its manifest's publication."""
        return self.released_at if self.released_at is not None else self.published_at


@dataclass(frozen=True)
class RunBill:
    """A flow run of the pool: ``run_id``, ``job`` (its name), ``tenant``, ``created`` (Unix seconds it was
    submitted: its creation, or for a deployment's scheduled run its scheduled time),
    ``gpus`` (its request), ``ended`` (its state is final), its ``attempts`` (oldest first),
    ``failed_at`` (Unix seconds: when it ended Failed or Crashed; None otherwise), and ``waiting``
    (not ended, and holding no compute now: queued)."""

    run_id: str
    job: str
    tenant: str
    created: float
    gpus: int
    ended: bool
    attempts: tuple[Attempt, ...] = ()
    failed_at: float | None = None
    waiting: bool = False


@dataclass
class Row:
    """One row of ``e31 usage`` (module docstring for each field)."""

    key: str
    gpu_seconds: float = 0.0
    cpu_seconds: float = 0.0
    gpu_hours: float = 0.0
    cpu_hours: float = 0.0
    redone_gpu_hours: float = 0.0
    completed: int = 0
    partial: int = 0
    failed: int = 0
    running: int = 0
    queued: int = 0
    mean_wait_s: float | None = None
    _waits: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, float | int | str | None]:
        """The row as JSON-ready fields (hours rounded to the millisecond's share: 1e-6 h)."""
        return {"key": self.key, "gpu_seconds": round(self.gpu_seconds, 3), "cpu_seconds": round(self.cpu_seconds, 3),
                "gpu_hours": round(self.gpu_hours, 6), "cpu_hours": round(self.cpu_hours, 6),
                "redone_gpu_hours": round(self.redone_gpu_hours, 6), "completed": self.completed,
                "partial": self.partial, "failed": self.failed, "running": self.running,
                "queued": self.queued,
                "mean_wait_s": None if self.mean_wait_s is None else round(self.mean_wait_s, 3)}


def _day(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%d")


def usage_rows(runs: Iterable[RunBill], since: float, by: str = "tenant") -> list[Row]:
    """The rows of ``runs`` for the period from ``since`` (Unix seconds) to now, keyed ``by`` one of
    :data:`BY`, sorted by key.  An attempt counts when it was released in the period; a run's counts
    (ended ones by status, running ones, its wait) when its newest attempt was released in the period,
    or, still running, always.  Raises ``ValueError`` for an unknown ``by``."""
    if by not in BY:
        raise ValueError(f"by must be one of {', '.join(BY)} (got {by!r})")
    rows: dict[str, Row] = {}

    def row(key: str) -> Row:
        return rows.setdefault(key, Row(key))

    for run in runs:
        def key_of(at: float | None) -> str:
            return run.tenant if by == "tenant" else run.job if by == "job" else _day(at or run.created)

        for a in run.attempts:
            if a.released_at is None or a.released_at < since:
                continue
            r = row(key_of(a.released_at))
            r.gpu_seconds += a.gpu_seconds
            r.cpu_seconds += a.cpu_seconds
            r.gpu_hours = r.gpu_seconds / 3600.0
            r.cpu_hours = r.cpu_seconds / 3600.0
        newest = run.attempts[-1] if run.attempts else None
        released = newest.at if newest is not None else None
        if not run.ended:  # counted in the period, on its day if it began in it
            r = row(key_of(max(released or run.created, since)))
            if run.waiting:
                r.queued += 1
            else:
                r.running += 1
        elif run.failed_at is not None:  # it ended Failed or Crashed, whatever its newest manifest says
            if run.failed_at < since:
                continue
            r = row(key_of(run.failed_at))
            r.failed += 1
            if newest is not None:
                r.redone_gpu_hours += newest.lost_s * run.gpus / 3600.0
        elif newest is not None and released is not None and released >= since:
            r = row(key_of(released))
            if newest.status in ("completed", "partial", "failed"):
                setattr(r, newest.status, getattr(r, newest.status) + 1)
            r.redone_gpu_hours += newest.lost_s * run.gpus / 3600.0
        else:
            continue
        first = next((a.started_at for a in run.attempts if a.started_at is not None), None)
        if first is not None:
            r._waits.append(max(first - run.created, 0.0))
    for r in rows.values():
        r.mean_wait_s = sum(r._waits) / len(r._waits) if r._waits else None
    return [rows[k] for k in sorted(rows)]
