"""Loading a job spec from a file, text or mapping: parse, override, resolve paths, validate."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .base import SpecModel
from .errors import DOCUMENT, Problem, SpecError, format_loc, short_repr
from .models import JobSpec
from .nesting import too_deep
from .overrides import apply_overrides
from .urls import resolve_path
from .yamlload import MAX_DOCUMENT_CHARS, YamlSyntaxError, YamlTooDeep, load_yaml

__all__ = ["load_spec", "parse_spec"]

# Locations of URLs that are resolved when they are relative local paths.
_URL_FIELDS = (("output", "url"), ("output", "checkpoint", "url"))


class _DupDict(dict):
    duplicates: list[str]


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict:
    out = _DupDict()
    out.duplicates = []
    for key, value in pairs:
        if key in out:
            out.duplicates.append(key)
        out[key] = value
    return out


def _json_duplicates(data: Any, loc: tuple = ()) -> list[Problem]:
    problems: list[Problem] = []
    if isinstance(data, dict):
        for key in getattr(data, "duplicates", []):
            problems.append(Problem(format_loc((*loc, key)), "duplicate key (got it more than once); keep one"))
        for key, value in data.items():
            problems.extend(_json_duplicates(value, (*loc, key)))
    elif isinstance(data, list):
        for index, item in enumerate(data):
            problems.extend(_json_duplicates(item, (*loc, index)))
    return problems


def _deep_problem(model: type[SpecModel], loc: tuple) -> Problem:
    """The problem of a value nested too deeply at raw location ``loc``, worded as the model words it."""
    field, err = model.nesting_at(loc)
    ctx = err.context or {}
    return Problem(format_loc(field), f"{ctx['msg']} (got {ctx['got']}); {ctx['fix']}")


def _parse_json(text: str, source: str, model: type[SpecModel]) -> tuple[Any, list[Problem]]:
    try:
        data = json.loads(text, object_pairs_hook=_json_pairs)
    except json.JSONDecodeError as exc:
        raise SpecError(source, [Problem(f"{source}:{exc.lineno}:{exc.colno}", f"JSON syntax error: {exc.msg}")]) from None
    except RecursionError:  # deeper than Python's parser goes: the place is unknown
        raise SpecError(source, [Problem(source, "JSON syntax error: nested too deeply (thousands of levels)")]) from None
    except ValueError as exc:
        raise SpecError(source, [Problem(source, f"JSON syntax error: {exc}")]) from None
    deep = too_deep(data)  # before anything walks it recursively
    if deep is not None:
        raise SpecError(source, [_deep_problem(model, deep)])
    return data, _json_duplicates(data)


def _parse_text(text: str, source: str, as_json: bool,
                model: type[SpecModel] = JobSpec) -> tuple[Any, list[Problem]]:
    """``(data, problems that do not stop validation)`` of a spec (``model``: the document's model,
    which names the field holding a value nested too deeply). Raises SpecError for the others."""
    if len(text) > MAX_DOCUMENT_CHARS:
        raise SpecError(source, [Problem(source, f"the document has {len(text):,} characters; a spec may have at most "
                                                 f"{MAX_DOCUMENT_CHARS:,} (put large data in an input, not the spec)")])
    if as_json:
        return _parse_json(text, source, model)
    try:
        data, problems = load_yaml(text, source)
    except YamlTooDeep as exc:
        raise SpecError(source, [_deep_problem(model, exc.loc)]) from None
    except YamlSyntaxError as exc:
        raise SpecError(source, [exc.problem]) from None
    deep = too_deep(data)  # aliases can nest deeper than the text does
    if deep is not None:
        raise SpecError(source, [*problems, _deep_problem(model, deep)])
    return data, problems


def _read(path: str | os.PathLike[str], source: str) -> str:
    try:
        size = Path(path).stat().st_size
        if size > 4 * MAX_DOCUMENT_CHARS:  # refused unread: a spec is a few KB
            raise SpecError(source, [Problem(DOCUMENT, f"the file has {size:,} bytes; a spec may have at most "
                                                       f"{MAX_DOCUMENT_CHARS:,} characters")])
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        message = f"file not found (got {source!r}); check the path"
    except IsADirectoryError:
        message = f"is a directory, not a spec file (got {source!r})"
    except PermissionError:
        message = f"cannot read the file: permission denied (got {source!r})"
    except UnicodeDecodeError as exc:
        message = f"cannot read the file: not UTF-8 text ({exc.reason} at byte {exc.start})"
    except OSError as exc:
        message = f"cannot read the file: {exc.strerror or exc} (got {source!r})"
    raise SpecError(source, [Problem(DOCUMENT, message)])


def _from_override(loc: tuple, overridden: list[tuple]) -> bool:
    return any(loc[: len(done)] == done for done in overridden)


def _resolve_urls(data: dict[str, Any], base_dir: Any, overridden: list[tuple]) -> None:
    locations: list[tuple] = list(_URL_FIELDS)
    if isinstance(data.get("data"), list):
        locations += [("data", i, "url") for i in range(len(data["data"]))]
    cwd = os.getcwd()
    for loc in locations:
        parent = _lookup(data, loc[:-1])
        if not isinstance(parent, dict) or not isinstance(parent.get(loc[-1]), str):
            continue
        base = cwd if _from_override(loc, overridden) else base_dir
        parent[loc[-1]] = resolve_path(parent[loc[-1]], base)


def _lookup(data: Any, loc: tuple) -> Any:
    for part in loc:
        if isinstance(part, int):
            data = data[part] if isinstance(data, list) and part < len(data) else None
        else:
            data = data.get(part) if isinstance(data, dict) else None
    return data


#: A caller's extra checks of the raw spec (after overrides and path resolution): problems that
#: need the machine (installed protocols, the entrypoint's module), reported with the schema's.
Checks = Callable[[Mapping[str, Any]], Iterable[Problem]]


def _build(data: Any, source: str, base_dir: Any, overrides: Sequence[str], early: list[Problem],
           checks: Checks | None = None) -> JobSpec:
    if not isinstance(data, Mapping):
        got = "an empty document" if data is None else short_repr(data)
        raise SpecError(source, [*early, Problem(
            DOCUMENT,
            f"the document must be a mapping of spec_version, name, work, data, request, output (got {got})",
        )])
    deep = too_deep(data)  # a mapping given in Python: checked before it is copied
    if deep is not None:
        raise SpecError(source, [*early, _deep_problem(JobSpec, deep)])
    data = copy.deepcopy(dict(data))
    overridden, problems = apply_overrides(data, overrides)
    problems = early + problems
    _resolve_urls(data, base_dir, overridden)
    try:
        spec = JobSpec.model_validate(data)
    except SpecError as exc:
        problems += exc.problems
    except Exception as exc:  # never leak a traceback from loading
        problems.append(Problem(DOCUMENT, f"could not be validated: {type(exc).__name__}: {exc}"))
    if checks is not None:
        seen = {p.path for p in problems}
        try:
            problems += [p for p in checks(data) if p.path not in seen]
        except Exception as exc:  # a checker's own failure is reported, not raised
            problems.append(Problem(DOCUMENT, f"could not be checked: {type(exc).__name__}: {exc}"))
    if problems:
        raise SpecError(source, problems)
    return spec


def load_spec(path: str | os.PathLike[str], overrides: Sequence[str] = (), checks: Checks | None = None) -> JobSpec:
    """Load and validate a job spec file (``.json`` as JSON, anything else as YAML).

    ``overrides`` are ``DOTTED.PATH=VALUE`` strings (CLI ``--set``) applied
    before validation. Relative local paths in ``data[*].url``,
    ``output.url`` and ``output.checkpoint.url`` become absolute against the
    spec file's directory (against the current directory when they came from
    an override); ``~`` is expanded; URLs with a protocol are kept.
    Durations are timedeltas, memory is in bytes.  ``checks`` (optional)
    is called with the raw mapping and returns more problems, reported with
    the schema's (a field the schema already faults is not reported twice).

    Raises:
        SpecError: the file cannot be read, is not valid YAML/JSON, an
            override is malformed, or the spec is invalid; every problem is
            listed at once. No other exception escapes.
    """
    source = os.fspath(path)
    text = _read(path, source)
    data, early = _parse_text(text, source, as_json=str(source).lower().endswith(".json"))
    base_dir = os.path.dirname(os.path.abspath(source))
    return _build(data, source, base_dir, overrides, early, checks)


def parse_spec(
    data: Mapping[str, Any] | str,
    *,
    source: str = "<spec>",
    base_dir: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    checks: Checks | None = None,
) -> JobSpec:
    """Validate a job spec given as a mapping or as YAML text.

    Relative local paths resolve against ``base_dir`` (left as given when it
    is None); values set by ``overrides`` resolve against the current
    directory. ``source`` names the spec in messages. The mapping is not
    modified.  ``checks``: as for :func:`load_spec`.

    Raises:
        SpecError: invalid YAML, a malformed override, or an invalid spec;
            every problem is listed at once.
    """
    early: list[Problem] = []
    if isinstance(data, str):
        data, early = _parse_text(data, source, as_json=False)
    return _build(data, source, base_dir, overrides, early, checks)
