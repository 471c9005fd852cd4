"""Placement: plan a queue of declared jobs onto a pool of nodes, and replay workload traces.

Pure Python (no Prefect, fsspec or torch), so the live queue and offline
replays call the same code.  :func:`plan` is the planner
(:mod:`.planner` documents the policies and their guarantees);
:mod:`.simulate` replays jobs through it in simulated time; :mod:`.swf`
reads Standard Workload Format traces.
"""

from .model import Node, PlanInputError, Placement, QueuedJob, RunningJob
from .planner import POLICIES, plan

__all__ = ["Node", "POLICIES", "PlanInputError", "Placement", "QueuedJob", "RunningJob", "plan"]
