"""The JSON Schema of a job spec, for editors and ``e31 schema``."""

from __future__ import annotations

from typing import Any

from .models import JobSpec

__all__ = ["json_schema"]

_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of :class:`JobSpec` in validation mode.

    Durations are strings (pattern of the accepted forms) or a number of
    seconds; memory a string such as ``4GiB`` or an integer number of bytes;
    ``deadline`` a date-time string with a timezone. Every field has a title
    and a description. A new dict on each call; never raises.
    """
    schema = JobSpec.model_json_schema(mode="validation")
    return {
        "$schema": _DIALECT,
        "title": "E31 job spec",
        "description": (
            "A batch job for the E31 queue: work (what runs), data (inputs), "
            "request (resources and time) and output (destination and the files that end the job)."
        ),
        **{k: v for k, v in schema.items() if k not in ("title", "description")},
    }
