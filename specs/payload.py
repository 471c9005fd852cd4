"""A spec as JSON for Prefect: URLs masked, unless the real ones are asked for.

Every ``Url`` field (``data[*].url``, ``output.url``, ``output.checkpoint.url``)
is masked with :func:`e31.specs.mask_url` in JSON-mode dumps, so the parameters
Prefect stores (FastAPI's ``jsonable_encoder`` calls
``model_dump(mode="json")``) and shows never hold a signature or token.
Python-mode dumps and the model itself keep the real URLs.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from .errors import format_loc
from .fields import REVEAL_SECRETS

__all__ = ["secrets_in", "spec_payload"]


def spec_payload(spec: BaseModel, *, reveal: bool) -> dict[str, Any]:
    """The JSON-ready dump of ``spec`` (a JobSpec or any spec model).

    ``reveal=False``: URLs masked (safe to store and log); ``reveal=True``:
    the real URLs, for a process that must open them. Validating either
    dump gives the spec back (the masked one with masked URLs). Never raises
    for a valid model.
    """
    return spec.model_dump(mode="json", context={REVEAL_SECRETS: reveal})


def _differences(real: Any, masked: Any, loc: tuple) -> list[str]:
    if isinstance(real, dict) and isinstance(masked, dict):
        return [p for key in real for p in _differences(real[key], masked.get(key), (*loc, key))]
    if isinstance(real, list) and isinstance(masked, list):
        return [p for i, (a, b) in enumerate(zip(real, masked)) for p in _differences(a, b, (*loc, i))]
    return [format_loc(loc)] if real != masked else []


def secrets_in(spec: BaseModel) -> list[str]:
    """Field paths (``data[0].url``, ``output.url``...) whose value is masked in
    the JSON dump, i.e. where ``mask_url(url) != url``, in field order. Empty
    when the spec holds no credentials in URLs. Never raises for a valid model."""
    return _differences(spec_payload(spec, reveal=True), spec_payload(spec, reveal=False), ())
