"""Turn pydantic validation errors into Problems with friendly messages."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError

from .base import SPEC_ERROR
from .errors import Problem, SpecError, format_loc, short_repr
from .models import CheckpointPolicy, DataInput, JobSpec, OutputSpec, RequestSpec, WorkSpec

__all__ = ["JOB_WORDS", "NO_OUTPUT", "Vocabulary", "problems_from", "register_document", "spec_error_from"]

# Model found at a location, with list indexes dropped.
_MODELS: dict[tuple, type[BaseModel]] = {
    (): JobSpec,
    ("work",): WorkSpec,
    ("data",): DataInput,
    ("request",): RequestSpec,
    ("output",): OutputSpec,
    ("output", "checkpoint"): CheckpointPolicy,
}

#: Message for a spec without an output.
NO_OUTPUT = (
    "required: a job with no output has no end and is refused; add an output section, e.g. "
    "output: {kind: results, url: results/NAME/, files: [metrics.json]}, listing the files "
    "whose existence marks the job complete"
)

# What to add for a missing field (keyed by location without list indexes).
_ADD = {
    ("name",): "add e.g. name: digits-nightly-retrain",
    ("work",): "add e.g. work: {kind: training, entrypoint: module:function}",
    ("request",): "add e.g. request: {cpus: 1, limit: 30m}",
    ("work", "kind"): "add kind: training, inference, processing or simulation",
    ("data", "name"): "add e.g. name: digits",
    ("data", "url"): "add the input's URL or path, e.g. url: data/digits.csv.gz",
    ("output", "kind"): "add kind: model, results, files or report",
    ("output", "url"): "add the destination, e.g. url: results/NAME/",
    ("output", "files"): "add the files that mark the job complete, e.g. files: [metrics.json]",
}

_MAPPING_OF = {
    (): "spec_version, name, work, data, request, output",
    ("work",): "kind and entrypoint or command",
    ("data",): "name and url",
    ("request",): "gpus, cpus, memory, duration, limit",
    ("output",): "kind, url and files",
    ("output", "checkpoint"): "every or every_steps, and keep",
}


class Vocabulary(NamedTuple):
    """What a document's messages know of its models, keyed by location without list indexes:
    ``models`` (for did-you-mean), ``add`` (the fix for a missing field), ``mapping_of`` (the fields a
    mapping holds)."""

    models: Mapping[tuple, type[BaseModel]]
    add: Mapping[tuple, str]
    mapping_of: Mapping[tuple, str]


#: The job spec's vocabulary (the default of :func:`problems_from`).
JOB_WORDS = Vocabulary(_MODELS, _ADD, _MAPPING_OF)


def _shape(loc: tuple) -> tuple:
    return tuple(part for part in loc if not isinstance(part, int))


def _suggestion(loc: tuple, words: Vocabulary = JOB_WORDS) -> str | None:
    """The field an unknown key at ``loc`` was probably meant to be."""
    model = words.models.get(_shape(loc[:-1]))
    if model is None:
        return None
    match = difflib.get_close_matches(str(loc[-1]).lower(), list(model.model_fields), n=1, cutoff=0.6)
    return match[0] if match else None


def _unknown_field(loc: tuple, words: Vocabulary) -> str:
    suggestion = _suggestion(loc, words)
    if suggestion:
        return f"unknown field; did you mean {suggestion!r}?"
    model = words.models.get(_shape(loc[:-1]))
    if model is None:
        return "unknown field"
    return f"unknown field; allowed fields: {', '.join(model.model_fields)}"


def _expected(err: dict[str, Any], words: Vocabulary) -> tuple[str, str | None]:
    """(what was expected, fix or None) for a pydantic error."""
    kind, ctx, shape = err["type"], err.get("ctx") or {}, _shape(err["loc"])
    if kind == SPEC_ERROR:
        return ctx["msg"], ctx.get("fix")
    simple = {
        "greater_than_equal": f"must be >= {ctx.get('ge')}",
        "greater_than": f"must be > {ctx.get('gt')}",
        "less_than_equal": f"must be <= {ctx.get('le')}",
        "less_than": f"must be < {ctx.get('lt')}",
        "int_type": "must be a whole number",
        "int_parsing": "must be a whole number",
        "int_from_float": "must be a whole number",
        "string_type": "must be a string",
        "list_type": "must be a list",
        "bool_type": "must be true or false",
        "too_short": f"must have at least {ctx.get('min_length')} item(s)",
        "datetime_type": "must be a date-time with a timezone, e.g. 2026-11-30T06:00:00+00:00",
        "datetime_parsing": "must be a date-time with a timezone, e.g. 2026-11-30T06:00:00+00:00",
        "datetime_from_date_parsing": "must be a date-time with a timezone, e.g. 2026-11-30T06:00:00+00:00",
    }
    if kind in simple:
        return simple[kind], None
    if kind == "literal_error":
        expected = str(ctx.get("expected", ""))
        return (f"must be one of {expected}" if " or " in expected else f"must be {expected}"), None
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        fields = words.mapping_of.get(shape)
        return (f"must be a mapping of {fields}" if fields else "must be a mapping"), None
    message = err["msg"]
    return message[:1].lower() + message[1:], None


def _problem(err: dict[str, Any], words: Vocabulary) -> Problem:
    loc, kind = tuple(err["loc"]), err["type"]
    path = format_loc(loc)
    if words is JOB_WORDS and loc == ("output",) and (kind == "missing" or err.get("input") is None):
        return Problem(path, NO_OUTPUT)
    if kind == "missing":
        fix = words.add.get(_shape(loc))
        return Problem(path, "required field is missing" + (f"; {fix}" if fix else ""))
    if kind == "extra_forbidden":
        return Problem(path, _unknown_field(loc, words))
    expected, fix = _expected(err, words)
    ctx = err.get("ctx") or {}
    got = ctx["got"] if "got" in ctx else short_repr(err.get("input"))
    return Problem(path, f"{expected} (got {got})" + (f"; {fix}" if fix else ""))


def problems_from(exc: ValidationError, words: Vocabulary = JOB_WORDS) -> list[Problem]:
    """Friendly problems for every error in ``exc``: values first, then unknown fields.

    ``words``: the document's vocabulary (:data:`JOB_WORDS` for a job spec).

    A missing field is not reported when a misspelt key nearby is (the
    did-you-mean line says it).

    Within each group the order is pydantic's (document field order); exact
    duplicates are dropped.
    """
    errors = exc.errors(include_url=False)
    # "urll: did you mean 'url'?" already covers "url: required field is missing".
    misspelt = {
        (*err["loc"][:-1], suggestion)
        for err in errors
        if err["type"] == "extra_forbidden" and (suggestion := _suggestion(tuple(err["loc"]), words))
    }
    problems: list[Problem] = []
    for err in errors:
        if err["type"] == "missing" and tuple(err["loc"]) in misspelt:
            continue
        problem = _problem(err, words)
        if problem not in problems:
            problems.append(problem)
    return sorted(problems, key=lambda p: p.message.startswith("unknown field"))


# Documents whose models raise SpecError from Python: (vocabulary, what SpecError calls it, its source label).
_DOCUMENTS: list[tuple[Vocabulary, str, str]] = [(JOB_WORDS, "job spec", "<spec>")]


def register_document(words: Vocabulary, what: str, source: str) -> None:
    """Make the models of ``words`` (a document such as the pool) word their
    errors from Python with ``words``: ``SpecError(source, ..., what)``."""
    _DOCUMENTS.append((words, what, source))


def _shifted(words: Vocabulary, prefix: tuple) -> Vocabulary:
    """``words`` seen from the model at ``prefix`` (its locations made relative to it)."""
    def cut(table: Mapping[tuple, Any]) -> dict[tuple, Any]:
        return {loc[len(prefix):]: value for loc, value in table.items() if loc[: len(prefix)] == prefix}

    return Vocabulary(cut(words.models), cut(words.add), cut(words.mapping_of))


def spec_error_from(model: type[BaseModel], exc: ValidationError) -> SpecError:
    """The :class:`SpecError` for ``exc``, raised validating ``model`` from Python.

    A whole document (``JobSpec``) is worded exactly as :func:`e31.specs.parse_spec`
    words it (source ``<spec>``; ``<pool>`` for ``PoolSpec``); a part of one
    (``WorkSpec``...) has paths relative to itself and its class name as source
    (``invalid job spec <WorkSpec> (1 problem)``)."""
    for words, what, source in _DOCUMENTS:
        for loc, known in words.models.items():
            if known is model:
                if not loc:
                    return SpecError(source, problems_from(exc, words), what)
                return SpecError(f"<{model.__name__}>", problems_from(exc, _shifted(words, loc)), what)
    return SpecError(f"<{model.__name__}>", problems_from(exc, Vocabulary({(): model}, {}, {})))
