"""Command-line overrides (``--set DOTTED.PATH=VALUE``) applied to raw spec data."""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

from .errors import Problem, format_loc
from .urls import mask_url
from .yamlload import parse_yaml_value

__all__ = ["apply_overrides", "parse_override_path"]

_SEGMENT = re.compile(r"([^.\[\]]+)((?:\[[^\]]*\])*)")


class _OverrideError(ValueError):
    pass


def parse_override_path(path: str) -> list[str | int]:
    """Split ``data[0].url`` or ``data.0.url`` into ``["data", 0, "url"]``.

    All-digit dotted segments stay strings here; they index lists when applied.

    Raises:
        ValueError: empty segments, or a bracket that is not ``[N]``.
    """
    if not path:
        raise _OverrideError("the path before '=' is empty")
    parts: list[str | int] = []
    for segment in path.split("."):
        match = _SEGMENT.fullmatch(segment)
        if not match:
            raise _OverrideError(f"malformed path segment {segment!r}; use names and [N] indexes, e.g. data[0].url")
        parts.append(match.group(1))
        for index in re.findall(r"\[([^\]]*)\]", match.group(2)):
            if not index.isdigit():
                raise _OverrideError(f"list index [{index}] must be a whole number >= 0")
            parts.append(int(index))
    return parts


def _set(data: dict[str, Any], parts: list[str | int], value: Any) -> tuple:
    """Set ``value`` at ``parts``; returns the location actually used (indexes as ints)."""
    current: Any = data
    loc: list[str | int] = []
    for position, part in enumerate(parts):
        last = position == len(parts) - 1
        where = format_loc(loc) if loc else "the spec"
        if isinstance(current, list):
            if isinstance(part, str) and not part.isdigit():
                raise _OverrideError(f"{where} is a list; index it with a number, e.g. {where}[0]")
            index = int(part)
            if index >= len(current):
                raise _OverrideError(f"index {index} is out of range: {where} has {len(current)} item(s)")
            key: str | int = index
        elif isinstance(current, dict):
            if isinstance(part, int):
                raise _OverrideError(f"{where} is a mapping, not a list; [{part}] cannot index it")
            key = part
        else:
            raise _OverrideError(f"{where} is a {type(current).__name__}, not a mapping or list")
        loc.append(key)
        if last:
            current[key] = value
        else:
            nxt = current.get(key) if isinstance(current, dict) else current[key]
            following = parts[position + 1]
            if nxt is None and (isinstance(following, int) or following.isdigit()):
                raise _OverrideError(f"index {following} is out of range: {format_loc(loc)} has no items")
            if nxt is None:
                nxt = {}
                current[key] = nxt
            current = nxt
    return tuple(loc)


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> tuple[list[tuple], list[Problem]]:
    """Apply ``DOTTED.PATH=VALUE`` overrides to ``data`` in place, in order.

    VALUE is parsed as a YAML scalar or flow value with the spec loader (an
    empty VALUE is the empty string; ``null`` clears an optional field);
    missing intermediate mappings are created. Returns the locations set
    (for path resolution) and one problem per malformed override, with path
    ``--set OVERRIDE`` (URL credentials masked).
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    locations: list[tuple] = []
    problems: list[Problem] = []
    for override in overrides:
        head, eq, tail = str(override).partition("=")
        label = f"--set {head}{eq}{mask_url(tail)}"
        if not isinstance(override, str) or "=" not in override:
            problems.append(Problem(label, f"expected DOTTED.PATH=VALUE, e.g. request.limit=20s (got {str(override)!r})"))
            continue
        path, _, text = override.partition("=")
        try:
            value = parse_yaml_value(text) if text.strip() else ""  # "name=" is an empty value; null clears a field
            trial = copy.deepcopy(data)  # a failed override leaves no half-made mappings
            locations.append(_set(trial, parse_override_path(path.strip()), value))
        except _OverrideError as exc:
            problems.append(Problem(label, f"{exc}"))
        except ValueError as exc:
            problems.append(Problem(label, f"the value is not valid YAML (got {text!r}); {exc}"))
        else:
            data.clear()
            data.update(trial)
    return locations, problems
