"""What ``e31 worker`` checks at its start: this machine has what the pool
file declares for its node (GPUs, CPUs, memory)."""

from __future__ import annotations

import os
from typing import Any

from e31.errors import InvalidInput


class NodeMismatch(InvalidInput):
    """This machine has less than the pool file declares for the worker's node."""


def check_node(declared: Any, gpus: int | None = None) -> None:
    """Refuse to serve a node this machine cannot give what the pool file
    declares: GPUs (``gpus``: the count to use instead of detecting, e.g.
    from ``E31_NODE_GPUS`` on a machine without GPUs in tests), CPUs, memory.
    Raises :class:`NodeMismatch` naming each shortfall."""
    from e31.flows.admission import this_node

    here = this_node()
    have_gpus = here.gpus if gpus is None else gpus
    short = []
    if declared.gpus > have_gpus:
        short.append(f"{declared.gpus} GPUs declared, {have_gpus} here")
    if declared.cpus > here.cpus:
        short.append(f"{declared.cpus} CPUs declared, {here.cpus} here")
    if declared.memory > here.memory:
        short.append(f"{declared.memory / 2**30:.1f} GiB of memory declared, {here.memory / 2**30:.1f} GiB here")
    if short:
        gpu_hint = ("; to try GPU placement on a machine without them, E31_NODE_GPUS=N makes the worker take N "
                    "GPUs as found" if declared.gpus > have_gpus and gpus is None else "")
        raise NodeMismatch(f"this machine ({here.name}) cannot be node {declared.name!r} of the pool: "
                           + "; ".join(short) + "; start the worker on a machine that has them, or declare what this "
                           "one has in the pool file" + gpu_hint)


def node_gpus_override() -> int | None:
    """``E31_NODE_GPUS``: the GPU count a worker declares for its node
    instead of detecting it (for tests on machines without GPUs)."""
    text = os.environ.get("E31_NODE_GPUS")
    return int(text) if text and text.strip().isdigit() else None
