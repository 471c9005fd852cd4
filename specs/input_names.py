"""Input names within a job: unique, and distinct as the environment variables a command sees."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import RuleError, spec_error
from .fields import input_key

__all__ = ["input_name_problems"]


def input_name_problems(data: Mapping[str, Any]) -> list[RuleError]:
    """Problems at ``data[i].name`` in raw JobSpec input ``data``: a name used twice, or two
    names that a command would see as the same ``E31_DATA_<NAME>`` variable. Names that are
    not valid are left to their own check."""
    inputs = data.get("data")
    if not isinstance(inputs, list):
        return []
    first: dict[str, tuple[int, str]] = {}
    problems: list[RuleError] = []
    for index, item in enumerate(inputs):
        name = input_key(item.get("name") if isinstance(item, Mapping) else getattr(item, "name", None))
        if name is None:
            continue
        variable = "E31_DATA_" + name.upper().replace("-", "_").replace(".", "_")
        if variable in first:
            other, other_name = first[variable]
            if other_name == name:
                err = spec_error(f"duplicate input name; data[{other}] already uses it", fix="give each input its own name")
            else:
                err = spec_error(f"clashes with data[{other}] '{other_name}': a command sees both as {variable}",
                                 fix="rename one of them")
            problems.append((("data", index, "name"), err, name))
        else:
            first[variable] = (index, name)
    return problems
