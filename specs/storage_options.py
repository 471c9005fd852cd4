"""``storage_options``: fsspec filesystem options for a URL, with credentials by reference only.

A value is any JSON value, or a reference resolved on the worker at run time
(``e31.tasks.storage.credentials.resolve_options``):

* ``{secret: NAME}`` -- the value of the Prefect Secret block NAME (lowercase
  letters, digits and dashes);
* ``{env: NAME}`` -- the environment variable NAME (``[A-Za-z_][A-Za-z0-9_]*``).

A literal value under a credential-looking key (:func:`is_credential_key`),
at any depth, is refused: the spec is stored in Prefect parameters and shown
in logs. So is one under a credential-looking HTTP header name
(:func:`~e31.specs.credential_keys.is_credential_header`: ``Authorization``,
``Cookie``, ``X-Api-Key``...) inside a ``headers`` mapping at any depth (or a
``[NAME, VALUE]`` pair in a ``headers`` list), and an empty value (``""``,
``{}``, ``[]``) under either: it is not a reference. Refusals never show the
refused value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ValidationError, WithJsonSchema

from .base import spec_error
from .credential_keys import (CREDENTIAL_KEYS, CREDENTIAL_WORDS, HEADER_WORDS, PATH_SUFFIXES, TOKEN_MODES,
                              is_auth_mode, is_credential_header, is_credential_key, is_headers_key)
from .fields import check_json, has_password, password_error

__all__ = [
    "BLOCK_NAME", "CREDENTIAL_KEYS", "CREDENTIAL_WORDS", "ENV_NAME", "OPTIONS_HELP", "REFERENCE_KINDS", "StorageOptions",
    "check_storage_options", "is_credential_key", "reference_of",
]

#: The keys of a reference: ``{secret: BLOCK_NAME}`` or ``{env: VAR_NAME}``.
REFERENCE_KINDS = ("secret", "env")
BLOCK_NAME = r"^[a-z0-9-]+$"
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_NAME = {"secret": re.compile(BLOCK_NAME), "env": re.compile(ENV_NAME)}
_NAME_RULE = {
    "secret": ("must name a Prefect Secret block: lowercase letters, digits and dashes", "e.g. {secret: s3-credentials}"),
    "env": ("must name an environment variable: letters, digits and '_', not starting with a digit",
            "e.g. {env: AWS_SECRET_ACCESS_KEY}"),
}
_HIDDEN = "***"  # the input recorded with a refusal, instead of the value

LITERAL_MESSAGE = "a credential written into the spec would be stored in Prefect parameters and shown in logs"
LITERAL_FIX = (
    "use {secret: BLOCK_NAME} (a Prefect Secret block) or {env: VAR_NAME}, or leave it out and set the store's "
    "standard environment variables (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, "
    "AZURE_STORAGE_ACCOUNT_KEY)"
)
EMPTY_MESSAGE = "an empty credential is not a reference: it would be passed to the store as the credential"
OPTIONS_HELP = "fsspec options for the url (endpoint_url, client_kwargs...); credentials as {secret: BLOCK} or {env: VAR}."
JSON_FIX = "storage options are passed to fsspec as JSON; write other values out as strings"


def reference_of(value: object) -> tuple[str, str] | None:
    """``("secret", NAME)`` or ``("env", NAME)`` for a valid reference; None for
    anything else (a malformed reference included). Never raises."""
    if isinstance(value, Mapping) and len(value) == 1:
        kind, name = next(iter(value.items()))
        if kind in _NAME and isinstance(name, str) and _NAME[kind].match(name):
            return kind, name
    return None


def _looks_like_reference(value: object) -> bool:
    return isinstance(value, Mapping) and any(kind in value for kind in REFERENCE_KINDS)


def _what(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "an empty name" if not value.strip() else "a name with other characters"
    return {type(None): "null", list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def _reference_problems(value: Mapping, loc: tuple) -> list[tuple[tuple, Any]]:
    if len(value) != 1:
        keys = ", ".join(str(key) for key in value)
        return [(loc, spec_error(
            "a reference must have exactly one key, 'secret' or 'env'",
            fix="write {secret: BLOCK_NAME} (a Prefect Secret block) or {env: VAR_NAME} on its own",
            got=f"keys {keys}",
        ))]
    kind, name = next(iter(value.items()))
    if reference_of(value):
        return []
    message, fix = _NAME_RULE[kind]
    return [((*loc, kind), spec_error(message, fix=fix, got=_what(name)))]


def _empty(value: object) -> str | None:
    """What an empty value is (``""``, ``{}``, ``[]``), or None for any other value."""
    if isinstance(value, str) and not value.strip():
        return "an empty string"
    if isinstance(value, (Mapping, list, tuple)) and not value:
        return "an empty mapping" if isinstance(value, Mapping) else "an empty list"
    return None


def _entries(value: Mapping, loc: tuple, secret: bool, headers: bool) -> list[tuple[tuple, Any]]:
    """Refusals in the items of a mapping at ``loc``; ``headers``: its keys are HTTP header names."""
    return [
        p for key, item in value.items() if not (not headers and is_auth_mode(key, item))
        for p in _problems(item, (*loc, key), secret or _secret_name(key, headers), headers or is_headers_key(key))
    ]


def _secret_name(key: object, headers: bool) -> bool:
    return is_credential_header(key) if headers else is_credential_key(key)


def _header_pair(value: object) -> bool:
    """True for ``[NAME, VALUE]`` with a credential-looking header NAME (a pair in a ``headers`` list)."""
    return isinstance(value, (list, tuple)) and len(value) == 2 and is_credential_header(value[0])


def _problems(value: object, loc: tuple, secret: bool, headers: bool = False) -> list[tuple[tuple, Any]]:
    """Refusals inside one option value at ``loc``; ``secret``: under a credential-looking key;
    ``headers``: inside a ``headers`` option."""
    if _looks_like_reference(value):
        return _reference_problems(value, loc)
    empty = _empty(value) if secret else None
    if empty:
        return [(loc, spec_error(EMPTY_MESSAGE, fix=LITERAL_FIX, got=empty))]
    if isinstance(value, Mapping):
        return _entries(value, loc, secret, headers)
    if isinstance(value, (list, tuple)):
        pair = headers and _header_pair(value)
        return [p for index, item in enumerate(value)
                for p in _problems(item, (*loc, index), secret or (pair and index == 1), headers)]
    if secret and value is not None and not isinstance(value, bool):  # null and true/false hold no secret
        return [(loc, spec_error(LITERAL_MESSAGE, fix=LITERAL_FIX, got="a literal value"))]
    if isinstance(value, str) and has_password(value):
        return [(loc, password_error())]
    return []


def check_storage_options(value: dict[str, Any]) -> dict[str, Any]:
    """Validate storage options (see the module docstring).

    Raises pydantic.ValidationError with one line per problem, at the path of
    the refused value (its input recorded as ``***``): a literal or empty
    value under a credential-looking key or HTTP header name, a reference
    with other keys or a bad name, a URL with a password, or a value that is
    not JSON.
    """
    problems = _entries(value, (), False, False)
    if not problems:
        return check_json(value, fix=JSON_FIX)
    try:
        check_json(value, fix=JSON_FIX)
    except ValueError as exc:
        problems.insert(0, ((), exc))
    raise ValidationError.from_exception_data("storage_options", [
        {"type": error, "loc": loc, "input": _HIDDEN} for loc, error in problems
    ])


_REFERENCE_SCHEMAS = [
    {"type": "object", "title": "Secret reference", "description": "The value of the Prefect Secret block NAME.",
     "properties": {"secret": {"type": "string", "pattern": BLOCK_NAME}}, "required": ["secret"],
     "additionalProperties": False},
    {"type": "object", "title": "Environment reference", "description": "The environment variable NAME on the worker.",
     "properties": {"env": {"type": "string", "pattern": ENV_NAME}}, "required": ["env"],
     "additionalProperties": False},
]
_OTHER_JSON = {
    "description": "Any other JSON value, passed to the filesystem as given.",
    "not": {"type": "object", "anyOf": [{"required": ["secret"]}, {"required": ["env"]}]},
}



def _loose(word: str) -> str:
    """A regular expression matching ``word`` in any case with ``_``, ``-``
    or whitespace between its letters (what :func:`normalise_name` drops),
    in the syntax JSON Schema, Python and JavaScript share."""
    return "[-_\\s]*".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in word)


#: JSON Schema pattern of the top-level option keys :func:`is_credential_key`
#: calls credentials, so a Prefect server refuses a literal credential typed
#: into a deployment's run form before storing it as a parameter.
CREDENTIAL_KEY_PATTERN = (
    "^(?!.*(?:" + "|".join(_loose(s) for s in PATH_SUFFIXES) + ")[-_\\s]*$)"
    "(?:.*(?:" + "|".join(_loose(w) for w in CREDENTIAL_WORDS) + ").*"
    "|[-_\\s]*(?:" + "|".join(_loose(k) for k in sorted(CREDENTIAL_KEYS)) + ")[-_\\s]*)$"
)
#: JSON Schema pattern of the HTTP header names :func:`is_credential_header`
#: calls credentials (``Authorization``, ``Cookie``, ``X-Api-Key``...).
CREDENTIAL_HEADER_PATTERN = (
    f"(?:{CREDENTIAL_KEY_PATTERN})|^.*(?:" + "|".join(_loose(w) for w in HEADER_WORDS) + ").*$"
)
_CREDENTIAL_VALUE = {
    "description": "A credential: a reference only (or null / true / false, or a gcsfs token mode).",
    "anyOf": [*_REFERENCE_SCHEMAS, {"type": ["null", "boolean"]}, {"enum": sorted(TOKEN_MODES)}],
}

#: HTTP headers as fsspec's HTTP filesystem takes them (``headers`` or
#: ``client_kwargs.headers``): credential header values must be references.
_HEADERS = {"description": "HTTP headers; credentials ({secret:} or {env:}) only under names such as Authorization.",
            "anyOf": [{"type": "object", "patternProperties": {CREDENTIAL_HEADER_PATTERN: _CREDENTIAL_VALUE}},
                      {"not": {"type": "object"}}]}

#: fsspec filesystem options (``endpoint_url``, ``client_kwargs``, ``anon``...): JSON values or references.
#: The JSON Schema (what Prefect checks a run's parameters against before
#: storing them) refuses literals under top-level credential keys and
#: credential header names in ``headers`` / ``client_kwargs.headers``; the
#: validator refuses them at any depth.
StorageOptions = Annotated[
    dict[str, Any],
    BeforeValidator(lambda value: {} if value is None else value),  # "storage_options:" with nothing under it
    AfterValidator(check_storage_options),
    WithJsonSchema({
        "type": "object",
        "properties": {"headers": _HEADERS, "client_kwargs": {"type": "object", "properties": {"headers": _HEADERS}}},
        "patternProperties": {CREDENTIAL_KEY_PATTERN: _CREDENTIAL_VALUE},
        "additionalProperties": {"anyOf": [*_REFERENCE_SCHEMAS, _OTHER_JSON]},
    }),
]
