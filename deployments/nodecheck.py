"""What ``e31 worker`` checks at its start: this machine has what the pool
file declares for its node (GPUs, CPUs, memory)."""

from __future__ import annotations

import os
from typing import Any

from e31.errors import InvalidInput


class NodeMismatch(InvalidInput):
    """This machine has less than the pool file declares for the worker's node."""


def check_node(declared: Any, gpus: int | None = None, cpus: int | None = None, memory: int | None = None) -> None:
    """Refuse to serve a node this machine cannot give what the pool file
    declares: GPUs, CPUs, memory (bytes).  ``gpus``, ``cpus``, ``memory``:
    what to take as found instead of detecting it (``E31_NODE_GPUS``,
    ``E31_NODE_CPUS``, ``E31_NODE_MEMORY``: :func:`node_overrides`), for
    trying a pool's placement on a smaller machine.  Raises
    :class:`NodeMismatch` naming each shortfall, and the variable that
    would let a trial go on."""
    from e31.flows.admission import this_node

    here = this_node()
    have_gpus = here.gpus if gpus is None else gpus
    have_cpus = here.cpus if cpus is None else cpus
    have_memory = here.memory if memory is None else memory
    short = []
    if declared.gpus > have_gpus:
        short.append(f"{declared.gpus} GPUs declared, {have_gpus} here")
    if declared.cpus > have_cpus:
        short.append(f"{declared.cpus} CPUs declared, {have_cpus} here")
    if declared.memory > have_memory:
        short.append(f"{declared.memory / 2**30:.1f} GiB of memory declared, {have_memory / 2**30:.1f} GiB here")
    if short:
        gpu_hint = ("; to try GPU placement on a machine without them, E31_NODE_GPUS=N makes the worker take N "
                    "GPUs as found" if declared.gpus > have_gpus and gpus is None else "")
        names = [v for v, over, big in (("E31_NODE_CPUS=N", cpus, declared.cpus > have_cpus),
                                        ("E31_NODE_MEMORY=SIZE", memory, declared.memory > have_memory))
                 if big and over is None]
        size_hint = (f"; to try a pool's placement on a smaller machine, {' and '.join(names)} make the worker take "
                     "them as found (for trying only: the work gets what this machine has)" if names else "")
        raise NodeMismatch(f"this machine ({here.name}) cannot be node {declared.name!r} of the pool: "
                           + "; ".join(short) + "; start the worker on a machine that has them, or declare what this "
                           "one has in the pool file" + gpu_hint + size_hint)


def node_overrides() -> tuple[int | None, int | None, int | None]:
    """``(gpus, cpus, memory in bytes)`` a worker takes as found instead of detecting them, from
    ``E31_NODE_GPUS``, ``E31_NODE_CPUS`` and ``E31_NODE_MEMORY`` (``64GiB``, ``512MB``); None for
    each one unset.  For trying a pool's placement on a smaller machine only: the work still gets
    what this machine has.

    Raises:
        InvalidInput: a value that is not a whole number (a size for memory), naming the variable.
    """
    from e31.specs.units import parse_memory

    found: list[int | None] = []
    for name in ("E31_NODE_GPUS", "E31_NODE_CPUS"):
        text = (os.environ.get(name) or "").strip()
        if text and not (text.isascii() and text.isdigit()):
            raise InvalidInput(f"{name}: must be a whole number of {name[9:].lower()} (got {text!r}); set e.g. "
                               f"{name}=8, or unset it to detect them")
        found.append(int(text) if text else None)
    text = (os.environ.get("E31_NODE_MEMORY") or "").strip()
    memory = None
    if text:
        try:
            memory = parse_memory(text)
        except ValueError:
            raise InvalidInput(f"E31_NODE_MEMORY: must be a size such as 64GiB or 512MB (got {text!r}); set it so, "
                               "or unset it to detect the memory") from None
    return found[0], found[1], memory


def node_gpus_override() -> int | None:
    """``E31_NODE_GPUS``: the GPU count a worker declares for its node
    instead of detecting it (for tests on machines without GPUs)."""
    text = os.environ.get("E31_NODE_GPUS")
    return int(text) if text and text.strip().isascii() and text.strip().isdigit() else None
