"""``storage_options``: fsspec filesystem options for a URL, with credentials by reference only.

A value is any JSON value, or a reference resolved on the worker at run time
(``tasks.credentials.resolve_options``):

* ``{secret: NAME}`` -- the value of the Prefect Secret block NAME (lowercase
  letters, digits and dashes);
* ``{env: NAME}`` -- the environment variable NAME (``[A-Za-z_][A-Za-z0-9_]*``).

A literal value under a credential-looking key (:func:`is_credential_key`),
at any depth, is refused: the spec is stored in Prefect parameters and shown
in logs. Refusals never show the refused value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ValidationError, WithJsonSchema

from .base import spec_error
from .fields import check_json, has_password, password_error

__all__ = [
    "BLOCK_NAME", "CREDENTIAL_KEYS", "CREDENTIAL_WORDS", "ENV_NAME", "OPTIONS_HELP", "REFERENCE_KINDS", "StorageOptions",
    "check_storage_options", "is_credential_key", "reference_of",
]

#: Keys containing one of these (case-insensitive) hold credentials.
CREDENTIAL_WORDS = (
    "secret", "password", "passwd", "token", "credential", "sas", "account_key", "connection_string", "private_key",
)
#: Keys that hold credentials when they are exactly one of these (case-insensitive).
CREDENTIAL_KEYS = frozenset({"key", "aws_access_key_id", "aws_secret_access_key", "aws_session_token"})
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
OPTIONS_HELP = "fsspec options for the url (endpoint_url, client_kwargs...); credentials as {secret: BLOCK} or {env: VAR}."
JSON_FIX = "storage options are passed to fsspec as JSON; write other values out as strings"


def is_credential_key(key: object) -> bool:
    """True for a key that names a credential (case-insensitive): one containing
    secret, password, passwd, token, credential, sas, account_key,
    connection_string or private_key, or exactly key, aws_access_key_id,
    aws_secret_access_key or aws_session_token. False for non-strings."""
    if not isinstance(key, str):
        return False
    name = key.strip().lower()
    return name in CREDENTIAL_KEYS or any(word in name for word in CREDENTIAL_WORDS)


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


def _problems(value: object, loc: tuple, secret: bool) -> list[tuple[tuple, Any]]:
    """Refusals inside one option value at ``loc``; ``secret``: under a credential-looking key."""
    if _looks_like_reference(value):
        return _reference_problems(value, loc)
    if isinstance(value, Mapping):
        return [p for key, item in value.items() for p in _problems(item, (*loc, key), secret or is_credential_key(key))]
    if isinstance(value, (list, tuple)):
        return [p for index, item in enumerate(value) for p in _problems(item, (*loc, index), secret)]
    if secret and value is not None and not isinstance(value, bool):  # null and true/false hold no secret
        return [(loc, spec_error(LITERAL_MESSAGE, fix=LITERAL_FIX, got="a literal value"))]
    if isinstance(value, str) and has_password(value):
        return [(loc, password_error())]
    return []


def check_storage_options(value: dict[str, Any]) -> dict[str, Any]:
    """Validate storage options (see the module docstring).

    Raises pydantic.ValidationError with one line per problem, at the path of
    the refused value (its input recorded as ``***``): a literal under a
    credential-looking key, a reference with other keys or a bad name, a URL
    with a password, or a value that is not JSON.
    """
    problems = [p for key, item in value.items() for p in _problems(item, (key,), is_credential_key(key))]
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

#: fsspec filesystem options (``endpoint_url``, ``client_kwargs``, ``anon``...): JSON values or references.
StorageOptions = Annotated[
    dict[str, Any],
    BeforeValidator(lambda value: {} if value is None else value),  # "storage_options:" with nothing under it
    AfterValidator(check_storage_options),
    WithJsonSchema({"type": "object", "additionalProperties": {"anyOf": [*_REFERENCE_SCHEMAS, _OTHER_JSON]}}),
]
