"""Attained service: the order of preemptible jobs that declared no duration (pure, no IO).

A job that declares only a ``limit`` gives the planner no run time to plan with: planned as if it
ran to its limit it rarely fits a gap, and it waits behind everything.  When it is also preemptible
(``request.preemptible``; it checkpoints, so a preemption loses at most one checkpoint interval) the
planner treats it as Tiresias does (Gu et al., "Tiresias: A GPU Cluster Manager for Distributed
Deep Learning", NSDI 2019, its discretised two-dimensional least-attained-service policy):

* **Levels.**  Its *attained service* is the resource-seconds it has received so far (GPUs times
  seconds on the node; CPUs times seconds for a job of no GPU), over all its runs.  The thresholds
  :data:`LEVELS_S` cut that into a few levels; a lower level ranks higher, and within a level the
  job that arrived first goes first.  Jobs that are short in fact finish in the first levels,
  ahead of long ones, without anyone declaring how long they are.
* **Room.**  It starts in any room free now, capacity reserved for a later job included, without
  a proof that it ends before the reservation (:mod:`.planner`).  When the reservation's job, or a
  waiting job :data:`PREEMPT_GAP` levels lower, needs the room it is preempted (:func:`ranks_above`,
  :func:`.preemption.plan_preemptions`): it stops with its checkpoint and waits again.  Tiresias
  preempts for any difference of level; with the gap of two, only a job that has received less than
  the first threshold (or a starving job) preempts, and only jobs past the last: each preemption
  then makes room for a job far less served; in replays of a generated GPU-cluster workload (``bench_attained.py``) it
  halved the preemptions and the GPU-hours they lost for the same mean completion (the
  measurements: docs/performance.md, "Jobs without a duration in simulation").
* **Starvation bound.**  A job that has waited (since its submission, or since its last preemption)
  :data:`STARVE_FACTOR` times as long as it has run goes to level 0 ahead of every other job
  there (Tiresias' promotion rule): the longer the pool keeps it waiting relative to the service it
  got, the higher it ranks, so how long it may wait grows with the service it has had, not with a
  fixed number of hours.  A job that has run nothing yet is at level 0 already.  The factor, 8, was
  chosen in the same replays: at 2 or 4 promoted long jobs preempt each other in turn (30% and 17%
  more preemptions, longer maximum waits).

The ageing bound of :mod:`.policy` does not apply to these jobs: under load nearly every job waits
past a fixed number of hours, and an order by arrival from then on is FCFS again.
"""

from __future__ import annotations

from bisect import bisect_right

from .model import QueuedJob, RunningJob

__all__ = ["LEVELS_S", "PREEMPT_GAP", "STARVE_FACTOR", "by_attained", "level", "rank", "ranks_above", "running_attained",
           "starving", "width"]

#: Level thresholds in resource-seconds (GPU-seconds): below the first, level 0; from the last, the deepest level.
LEVELS_S = (3_600.0, 36_000.0)
#: A job that has waited this many times the seconds it has run ranks first at level 0.
STARVE_FACTOR = 8.0
#: Levels a running job must be deeper than a waiting one to be preempted for it (attained service).
PREEMPT_GAP = 2


def by_attained(job: QueuedJob) -> bool:
    """Whether the planner orders ``job`` by attained service: it is preemptible, declared no duration
    (its estimate is its limit) and runs on one node (a multi-node job is never preempted, so it is
    planned on its limit)."""
    return job.preemptible and job.runtime_source == "limit" and job.nodes == 1


def width(gpus: int, cpus: int) -> int:
    """The resource a job's service is counted in: its GPUs, or its CPUs when it asks for no GPU."""
    return gpus or cpus


def level(attained_s: float) -> int:
    """The level (0 = least served) of a job that has received ``attained_s`` resource-seconds."""
    return bisect_right(LEVELS_S, attained_s)


def running_attained(job: RunningJob, now: float) -> float:
    """Resource-seconds a running job has received by ``now`` (Unix seconds): its earlier runs' and
    this one's since its start."""
    return job.attained_s + width(len(job.devices), job.cpus) * max(now - job.start, 0.0)


def starving(job: QueuedJob, now: float) -> bool:
    """Whether ``job`` has waited at least :data:`STARVE_FACTOR` times the seconds it has run
    (its attained service over its width); never for a job that has not run."""
    if job.attained_s <= 0:
        return False
    ran = job.attained_s / max(width(job.gpus, job.cpus), 1)
    since = job.waiting_since if job.waiting_since is not None else job.submitted
    return now - since >= STARVE_FACTOR * ran


def rank(job: QueuedJob, now: float) -> tuple[int, int]:
    """``(0 if starving else 1, level)``: the order key of a job ordered by attained service (the
    caller breaks ties by arrival).  A starving job ranks as level 0."""
    if starving(job, now):
        return 0, 0
    return 1, level(job.attained_s)


def ranks_above(job: QueuedJob, victim: RunningJob, now: float) -> bool:
    """Whether the waiting ``job`` may preempt the running ``victim`` for attained service: the
    victim declared no duration (``no_duration``: it is ordered by attained service) and has reached
    a level at least :data:`PREEMPT_GAP` deeper than the job's (a starving job counts as level 0; a
    job that declared its duration, by its service so far: 0 before its first run).  The pool's rules
    (minimum run, daily cap, ``preemptible``) are checked apart (:func:`.preemption.may_preempt`)."""
    if not victim.no_duration:
        return False
    mine = 0 if starving(job, now) else level(job.attained_s)
    return level(running_attained(victim, now)) >= mine + PREEMPT_GAP
