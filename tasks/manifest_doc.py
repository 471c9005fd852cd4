"""docs/manifest.md, generated from :mod:`e31.tasks.manifest_model`.

Regenerate with ``python -m e31.tasks.manifest_doc > docs/manifest.md``;
tests/tasks/test_manifest_doc.py fails while the page and the model differ.
"""

from __future__ import annotations

import sys
import types
import typing
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel

from e31.tasks.manifest_model import (REASON_MEANING, REASONS, STATUS_MEANING, STATUSES, Logs, Manifest,
                                      ManifestFile, Meter, ReturningNote)

COMMAND = "python -m e31.tasks.manifest_doc > docs/manifest.md"


def type_text(annotation: Any) -> str:
    """A field's type in JSON terms: ``string``, ``integer``, ``number``,
    ``boolean``, ``null``, ``"a" | "b"`` for a Literal, ``list of T``,
    ``object (T values)``, or a nested model's name."""
    origin = get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`\"{v}\"`" for v in get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        parts = []
        for arg in get_args(annotation):
            text = type_text(arg)
            if text not in parts:
                parts.append(text)
        if "number" in parts and "integer" in parts:  # JSON's number holds both (a value keeps its written form)
            parts.remove("integer")
        return " \\| ".join(parts)
    if origin is list:
        return f"list of {type_text(get_args(annotation)[0])}"
    if origin is dict:
        return f"object ({type_text(get_args(annotation)[1])} values)"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}[annotation]


def model_table(model: type[BaseModel]) -> list[str]:
    """One model as a markdown section: its docstring's first line, then
    a table of its fields (key, type, meaning) in the order written; a
    field with a default (absent from the file unless set) is ``optional``."""
    lines = [f"## {model.__name__}", "", (model.__doc__ or "").strip().splitlines()[0], "",
             "| key | type | meaning |", "|---|---|---|"]
    for name, field in model.model_fields.items():
        if field.is_required():
            shown = type_text(field.annotation)
        else:  # written only when set: never null on disk
            shown = type_text(field.annotation).replace(" \\| null", "") + ", optional"
        lines.append(f"| `{name}` | {shown} | {field.description} |")
    return lines + [""]


def render() -> str:
    """The whole page, ending in one newline."""
    lines = [
        f"<!-- Generated from tasks/manifest_model.py by `{COMMAND}`; do not edit by hand. -->",
        "",
        "# manifest.json",
        "",
        "Every return writes `manifest.json` last, beside the files it describes: at the top of `output.url` for "
        "a completed run, in `<output.url>/partial/` for any other. While a return is in progress the manifest "
        "there is a [ReturningNote](#returningnote); once it is done, a [Manifest](#manifest). Keys appear in "
        "the order below; a null value is written as `null` (only `stderr_tail` is ever absent).",
        "",
        "## status",
        "",
        "| status | meaning |",
        "|---|---|",
        *(f"| `{s}` | {STATUS_MEANING[s]} |" for s in (*STATUSES, "returning")),
        "",
        "## reason",
        "",
        "| reason | meaning |",
        "|---|---|",
        *(f"| `{r}` | {REASON_MEANING[r]} |" for r in REASONS),
        "",
    ]
    for model in (Manifest, ManifestFile, Meter, Logs, ReturningNote):
        lines += model_table(model)
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> int:
    """Print the page to stdout."""
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
