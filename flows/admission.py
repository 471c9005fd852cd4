"""Admission against this machine: refuse a request no node here can hold.

The default pool is this machine, detected: CPUs from ``os.cpu_count()``,
memory from ``sysconf`` (bytes), GPUs from ``CUDA_VISIBLE_DEVICES`` when set,
else the lines of ``nvidia-smi -L`` (0 when it is absent).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from e31.errors import E31Error
from e31.flows.compile import JobPlan

GIB = 1024**3


class AdmissionError(E31Error, RuntimeError):
    """The job cannot be admitted here: its request is larger than this
    machine, or its deadline leaves no time to run."""


@dataclass(frozen=True)
class Node:
    """A node's capacity: ``gpus``, ``cpus`` and ``memory`` in bytes."""

    name: str
    gpus: int
    cpus: int
    memory: int


def detect_gpus() -> int:
    """Number of GPUs this process may use (see module docstring)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def this_node() -> Node:
    """This machine as a :class:`Node`.  ``E31_NODE_CPUS`` and ``E31_NODE_MEMORY`` (``64GiB``), set to
    try a pool's placement on a smaller machine (``e31 worker`` checks them and passes them on to the
    runs it starts), are taken as found, so a run placed by the pool file is admitted; a value that
    does not parse is ignored here (the worker refuses it at its start)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpus = os.cpu_count() or 1
    text = (os.environ.get("E31_NODE_CPUS") or "").strip()
    if text.isascii() and text.isdigit():
        cpus = int(text)
    text = (os.environ.get("E31_NODE_MEMORY") or "").strip()
    if text:
        from e31.specs.units import parse_memory

        try:
            memory = parse_memory(text)
        except ValueError:
            pass
    return Node(name=os.uname().nodename, gpus=detect_gpus(), cpus=cpus, memory=memory)


def check_fits(plan: JobPlan, node: Node | None = None, placed_nodes: int = 1) -> Node:
    """Raise :class:`AdmissionError` naming each resource the request asks
    more of (per node) than ``node`` (default: this machine) has, or for a
    request of more nodes than its placement gives it (``placed_nodes``: the
    nodes a queue placed it on, 1 elsewhere:
    :func:`e31.flows.placement.refusals.multi_node_refusal`); returns the node."""
    if plan.nodes > placed_nodes:
        from e31.flows.placement.refusals import multi_node_refusal

        raise AdmissionError(multi_node_refusal(plan.nodes))
    node = node or this_node()
    short = []
    if plan.gpus > node.gpus:
        short.append(f"request.gpus: {plan.gpus} requested, this machine has {node.gpus}")
    if plan.cpus > node.cpus:
        short.append(f"request.cpus: {plan.cpus} requested, this machine has {node.cpus}")
    if plan.memory and plan.memory > node.memory:
        short.append(f"request.memory: {plan.memory / GIB:.1f} GiB requested, this machine has "
                     f"{node.memory / GIB:.1f} GiB")
    if short:
        raise AdmissionError(
            f"request does not fit this machine ({node.name}):\n  " + "\n  ".join(short) +
            "\n  ask for no more than it has, or deploy the job (e31 deploy) to a work pool whose workers run "
            "where the resources are")
    return node
