"""Builders shared by the placement tests: times from 2026-01-01 00:00 UTC, memory in GiB."""

from __future__ import annotations

from e31.flows.placement import Node, QueuedJob, RunningJob

T0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC
H = 3600.0
GIB = 1024**3


def node(name: str, gpus: int = 8, cpus: int = 64, memory_gib: int = 512, gpu_type: str | None = None) -> Node:
    return Node(name, gpus, cpus, memory_gib * GIB, gpu_type)


def running(job_id: str, on: str, devices, until_h: float, cpus: int = 4, memory_gib: int = 0) -> RunningJob:
    return RunningJob(job_id, on, tuple(devices), cpus, memory_gib * GIB, T0 - H, T0 + until_h * H)


def queued(job_id: str, gpus: int, hours: float, *, ago_h: float = 0.0, cpus: int = 4, memory_gib: int = 0,
           deadline_h: float | None = None, gpu_type: str | None = None, staging_s: float = 0.0,
           source: str = "duration", note: str = "") -> QueuedJob:
    return QueuedJob(
        id=job_id, name=job_id, gpus=gpus, cpus=cpus, memory=memory_gib * GIB, submitted=T0 - ago_h * H,
        runtime_s=hours * H, limit_s=hours * H * 2, gpu_type=gpu_type,
        deadline=None if deadline_h is None else T0 + deadline_h * H, staging_s=staging_s,
        runtime_source=source, runtime_note=note,
    )
