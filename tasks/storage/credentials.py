"""Credentials for storage: resolve the references in ``storage_options`` on the worker.

A spec's ``storage_options`` (on ``data[*]``, ``output``, ``output.checkpoint``)
hold JSON values and references only (see :mod:`e31.specs.storage_options`):

* ``{secret: NAME}`` -> ``prefect.blocks.system.Secret.load(NAME).get()``
  (a string, or the JSON value the block holds);
* ``{env: NAME}`` -> ``os.environ[NAME]`` on this worker.

Resolved options may hold secrets: pass them to fsspec only, never to
Prefect parameters, results or logs; log :func:`redact` of them instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from e31.errors import E31Error
from e31.specs import is_credential_key, mask_url, reference_of
from e31.specs.errors import format_loc
from e31.specs.storage_options import REFERENCE_KINDS
from e31.tasks.storage.masking import remember_secret

__all__ = ["CredentialError", "redact", "resolve_options"]

MASK = "***"


class CredentialError(E31Error, RuntimeError):
    """A reference in storage options could not be resolved on this worker.

    The message names the field path, the block or variable name and how to
    provide it; never a secret value.
    """


def _path(field: str, loc: tuple) -> str:
    return format_loc((*field.split("."), *loc)) if field else format_loc(loc)


def _is_reference_like(value: object) -> bool:
    return isinstance(value, Mapping) and any(kind in value for kind in REFERENCE_KINDS)


def _secret(name: str, where: str) -> Any:
    from prefect.blocks.system import Secret

    try:
        block = Secret.load(name, _sync=True)
    except ValueError as exc:
        if "Unable to find block document" not in str(exc):
            raise CredentialError(f"{where}: the Prefect Secret block '{name}' could not be loaded "
                                  f"({type(exc).__name__}); check its type is secret") from None
        raise CredentialError(
            f"{where}: the Prefect Secret block '{name}' does not exist on this Prefect server; "
            f"create it with: prefect block create secret (then name it {name}), "
            f"or in Python: Secret(value=...).save('{name}')"
        ) from None
    except Exception as exc:  # the API unreachable, or similar: its text holds no secret value
        raise CredentialError(f"{where}: could not read the Prefect Secret block '{name}': "
                              f"{type(exc).__name__}: {exc}; check PREFECT_API_URL on this worker") from None
    value = block.get()
    remember_secret(value)
    return value


def _env(name: str, where: str) -> str:
    try:
        value = os.environ[name]
    except KeyError:
        raise CredentialError(
            f"{where}: the environment variable {name} is not set on this worker; "
            f"set it where the worker runs, e.g. export {name}=..."
        ) from None
    if value == "":
        raise CredentialError(f"{where}: the environment variable {name} is set but empty on this worker; "
                              f"give it the value, e.g. export {name}=...")
    return value


def _resolve(value: Any, field: str, loc: tuple) -> Any:
    if _is_reference_like(value):
        ref = reference_of(value)
        where = _path(field, loc)
        if ref is None:
            raise CredentialError(f"{where}: not a valid reference; write {{secret: BLOCK_NAME}} or {{env: VAR_NAME}}")
        kind, name = ref
        return _secret(name, where) if kind == "secret" else _env(name, where)
    if isinstance(value, Mapping):
        return {key: _resolve(item, field, (*loc, key)) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_resolve(item, field, (*loc, index)) for index, item in enumerate(value)]
    return value


def resolve_options(options: Mapping[str, Any], field: str) -> dict[str, Any]:
    """A new dict of ``options`` with every reference replaced by its value.

    ``{secret: NAME}`` becomes ``Secret.load(NAME).get()`` (needs the Prefect
    API), ``{env: NAME}`` becomes ``os.environ[NAME]``, at any depth in
    mappings and lists; other values are copied as they are. ``field`` is the
    options' path in the spec (``output.storage_options``), used in messages
    as ``output.storage_options.key``. ``options`` is not modified.

    Raises:
        CredentialError: a Secret block that does not exist or cannot be read,
            an unset environment variable, or a malformed reference; the
            message names the path, the name and the fix, never a value.
    """
    return {key: _resolve(value, field, (key,)) for key, value in (options or {}).items()}  # the top is no reference


def uses_secret_blocks(options: Any) -> bool:
    """True when ``options`` (unresolved, at any depth) holds a ``{secret:
    BLOCK}`` reference, i.e. resolving them needs the Prefect API."""
    if _is_reference_like(value := options):
        ref = reference_of(value)
        return ref is not None and ref[0] == "secret"
    if isinstance(value, Mapping):
        return any(uses_secret_blocks(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(uses_secret_blocks(item) for item in value)
    return False


def _redact(value: Any, secret: bool) -> Any:
    if secret or _is_reference_like(value):
        return MASK
    if isinstance(value, Mapping):
        return {key: _redact(item, is_credential_key(key)) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact(item, False) for item in value]
    return mask_url(value) if isinstance(value, str) else value


def redact(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``options`` safe to log: every value under a credential-looking
    key (:func:`e31.specs.is_credential_key`, at any depth) and every reference
    becomes ``***``; strings are passed through :func:`e31.specs.mask_url`.

    Works on unresolved and resolved options alike, but a resolved reference
    under an ordinary key (``endpoint_url: {env: URL}``) cannot be told
    apart afterwards: redact the unresolved options when in doubt. Never raises.
    """
    return {key: _redact(value, is_credential_key(key)) for key, value in (options or {}).items()}
