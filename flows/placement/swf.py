"""Read a workload trace in the Standard Workload Format (SWF) of the Parallel Workloads Archive.

An SWF file has header comment lines starting with ``;`` (``; MaxProcs: 128``,
``; UnixStartTime: ...``) and one line per job of 18 whitespace-separated
fields, ``-1`` meaning unknown:

     1 job number          7 used memory (KB)        13 group
     2 submit time (s)     8 requested processors    14 application
     3 wait time (s)       9 requested time (s)      15 queue
     4 run time (s)       10 requested memory (KB)   16 partition
     5 allocated procs    11 status                  17 preceding job
     6 average CPU time   12 user                    18 think time

E31 maps a job to one node: its processors (requested, else allocated) become
``cpus``, or GPUs with ``as_="gpus"``; its requested time (else its run time)
becomes the ``limit`` and the planning estimate (``e31 simulate --default-limit`` gives a job with an
unknown requested time that limit instead: it declared no duration); its actual run time (capped at
the limit) is what the simulation runs.  Memory is not used (SWF gives it per
processor, often not at all).  Jobs with an unknown run time or no processors
(e.g. cancelled before they started) are skipped and counted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from e31.errors import InvalidInput

__all__ = ["SwfError", "Trace", "TraceJob", "read_swf"]


class SwfError(InvalidInput):
    """A trace that is not SWF: the message names the file, the line and the fix. Exits 2."""


@dataclass(frozen=True)
class TraceJob:
    """One job of a trace: ``submit`` (seconds from the trace's start), ``runtime_s`` (actual),
    ``limit_s`` (requested, else actual), ``procs`` (processors), ``declared`` (False when the
    requested time is unknown, -1: the job declared no duration), ``user`` (the submitter's id,
    ``""`` when unknown)."""

    id: str
    submit: float
    runtime_s: float
    limit_s: float
    procs: int
    declared: bool = True
    user: str = ""


@dataclass(frozen=True)
class Trace:
    """The jobs of a trace in file order, the trace's ``UnixStartTime`` (0 when absent) and how
    many job lines were skipped (unknown run time or processors)."""

    jobs: list[TraceJob]
    start: float
    skipped: int


def _number(text: str, path: str, line: int, field: int) -> float:
    try:
        return float(text)
    except ValueError:
        raise SwfError(f"{path}:{line}: field {field} must be a number (got {text!r}); an SWF job line has 18 "
                       "whitespace-separated numbers, -1 for unknown") from None


def read_swf(path: str | os.PathLike[str], limit_jobs: int | None = None) -> Trace:
    """Read the SWF file at ``path``; with ``limit_jobs``, only its first that many usable jobs.

    Raises:
        SwfError: the file cannot be read, or a job line does not have 18 numeric fields.
    """
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError as exc:
        raise SwfError(f"cannot read trace {source}: {exc.strerror or exc}; check the path") from None
    jobs, start, skipped = [], 0.0, 0
    for number, raw in enumerate(lines, 1):
        text = raw.strip()
        if not text:
            continue
        if text.startswith(";"):
            key, _, value = text[1:].partition(":")
            if key.strip() == "UnixStartTime" and value.strip().lstrip("-").isdigit():
                start = float(value.strip())
            continue
        fields = text.split()
        if len(fields) != 18:
            raise SwfError(f"{source}:{number}: expected 18 fields, got {len(fields)}; an SWF job line has 18 "
                           "whitespace-separated numbers, -1 for unknown (header lines start with ';')")
        values = [_number(f, source, number, k) for k, f in enumerate(fields, 1)]
        job_id, submit, _, run, alloc, _, _, req_procs, req_time = values[:9]
        user = str(int(values[11])) if values[11] >= 0 else ""
        procs = int(req_procs if req_procs > 0 else alloc)
        if run < 0 or procs <= 0 or submit < 0:
            skipped += 1
            continue
        limit = req_time if req_time > 0 else run
        jobs.append(TraceJob(str(int(job_id)), submit, min(run, max(limit, 0.0)), max(limit, 1.0), procs,
                             declared=req_time > 0, user=user))
        if limit_jobs is not None and len(jobs) >= limit_jobs:
            break
    return Trace(jobs, start, skipped)
