"""How deeply a spec may nest mappings and lists, measured without recursion.

A spec holds a few levels (``output.checkpoint.storage_options.client_kwargs``
is five); only free-form values (``work.params``, ``storage_options``) could
go deeper. Past :data:`MAX_NESTING` levels a value is refused before anything
walks it: copying, printing, hashing or storing it (Prefect keeps the spec as
JSON parameters) would exceed Python's recursion limit or pydantic's
serialisation depth (about 250 levels) and end in a traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

__all__ = ["MAX_NESTING", "NESTING_FIX", "nesting_message", "too_deep", "yaml_too_deep"]

#: Levels of mappings and lists a document may nest (the document itself is level 1).
MAX_NESTING = 64

#: How to repair a value nested too deeply.
NESTING_FIX = "flatten it, or put deeply nested data in an input file (data:) and read it in the work"


def nesting_message(limit: int = MAX_NESTING) -> tuple[str, str, str]:
    """``(message, got, fix)`` of the refusal of a value nested more than ``limit`` levels deep."""
    return (f"nested too deeply: a spec may nest mappings and lists at most {limit} levels deep, counted from "
            "the top of the document", f"more than {limit} levels", NESTING_FIX)


def too_deep(data: Any, limit: int = MAX_NESTING) -> tuple | None:
    """The location (keys and list indexes from ``data``) of the first
    mapping or list nested more than ``limit`` levels deep, counting ``data``
    itself as level 1 when it is a mapping or list; None when none is.

    Iterative, and it stops at the first one found, so a structure that
    holds itself (a cycle) is measured in bounded time."""
    if not isinstance(data, (Mapping, list, tuple)):
        return None
    stack: list[tuple[Any, tuple, int]] = [(data, (), 1)]
    while stack:
        value, loc, depth = stack.pop()
        if depth > limit:
            return loc
        if isinstance(value, Mapping):
            children = list(value.items())
        else:
            children = list(enumerate(value))
        for key, child in reversed(children):  # document order: the first deep value is named
            if isinstance(child, (Mapping, list, tuple)):
                stack.append((child, (*loc, key), depth + 1))
    return None


def yaml_too_deep(loader: yaml.SafeLoader, limit: int = MAX_NESTING) -> tuple | None:
    """The location of the first mapping or sequence nested more than
    ``limit`` levels deep, read from the parser's events (the composer that
    builds nodes recurses once per level and would overflow Python's stack
    first); None when none is. A complex (non-scalar) key is named ``?``."""
    frames: list[list[Any]] = []  # per open collection: [is_mapping, expecting_key, key or index]

    def value_done() -> None:
        if frames:
            frame = frames[-1]
            if frame[0]:
                frame[1] = not frame[1]

    def value_loc() -> tuple:
        return tuple(frame[2] for frame in frames)

    while True:
        event = loader.get_event()
        if isinstance(event, yaml.StreamEndEvent):
            return None
        if frames and not frames[-1][0] and isinstance(event, (yaml.NodeEvent, yaml.CollectionStartEvent)):
            frames[-1][2] += 1  # the next item of a sequence
        key_place = bool(frames) and frames[-1][0] and frames[-1][1]
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if key_place:
                frames[-1][2] = "?"
            if len(frames) >= limit:
                return value_loc()
            frames.append([isinstance(event, yaml.MappingStartEvent), True, -1])
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            frames.pop()
            value_done()
        elif isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent)):
            if key_place:
                frames[-1][2] = event.value if isinstance(event, yaml.ScalarEvent) else "?"
            value_done()
