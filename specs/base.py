"""The common model base: strict config, custom errors, and rules that never hide field errors.

Cross-field rules (``duration <= limit``, ``entrypoint`` xor ``command``...)
run on the raw input in a wrap validator, so they are reported together with
field errors of the same model instead of only after every field is valid.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from .live import LIVE_KEYS, LIVE_REASON, got_key, live_message

__all__ = ["SPEC_ERROR", "RuleError", "SpecModel", "spec_error"]

#: The pydantic error type used for E31's own messages.
SPEC_ERROR = "e31"

_UNSET: Any = object()


def spec_error(message: str, *, fix: str | None = None, got: str | None = None) -> PydanticCustomError:
    """A pydantic error carrying an E31 message.

    ``message`` says what was expected; ``fix`` (optional) how to repair it;
    ``got`` (optional) replaces the default ``repr`` of the input in
    ``(got X)``. The friendly formatter assembles ``message (got X); fix``.
    """
    ctx: dict[str, Any] = {"msg": message, "text": message + (f"; {fix}" if fix else "")}
    if fix:
        ctx["fix"] = fix
    if got is not None:
        ctx["got"] = got
    return PydanticCustomError(SPEC_ERROR, "{text}", ctx)


RuleError = tuple[tuple, PydanticCustomError, Any]  # (loc within the model, error, input)


def _line(loc: tuple, error: PydanticCustomError, value: Any) -> InitErrorDetails:
    return {"type": error, "loc": loc, "input": value}


def _reinstate(exc: ValidationError) -> list[InitErrorDetails]:
    """Turn reported errors back into raisable ones, keeping type, ctx and message."""
    lines: list[InitErrorDetails] = []
    for err in exc.errors(include_url=False):
        ctx = dict(err.get("ctx") or {})
        ctx["text"] = err["msg"]
        lines.append(_line(err["loc"], PydanticCustomError(err["type"], "{text}", ctx), err.get("input")))
    return lines


def _sort_key(loc: tuple, order: dict[str, int]) -> tuple[int, int]:
    """Field order, then list index: rule errors land among the field errors they belong with."""
    if not loc:  # whole-model rules after the field errors
        return (len(order) + 1, -1)
    index = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else -1
    return (order.get(loc[0], len(order)), index)


class SpecModel(BaseModel):
    """Base of all spec models: unknown fields forbidden, numbers accepted for strings.

    Subclasses may set ``live_keys_refused`` to refuse live-work keys
    (``port``, ``latency``...) with a reason instead of "unknown field", and
    override :meth:`_rules` for cross-field checks on the raw input.
    """

    # hide_input_in_errors: a ValidationError raised from Python (JobSpec.model_validate) never quotes the
    # input, which may be a URL with a password; E31's own messages show inputs masked
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, hide_input_in_errors=True)

    live_keys_refused: ClassVar[bool] = False

    @classmethod
    def _rules(cls, data: Mapping[str, Any]) -> list[RuleError]:
        """Cross-field problems in raw input ``data``; locations are relative to the model."""
        return []

    @model_validator(mode="wrap")
    @classmethod
    def _validate_all(cls, data: Any, handler):
        if not isinstance(data, Mapping):
            return handler(data)
        extra: list[InitErrorDetails] = []
        if cls.live_keys_refused:
            live = [k for k in data if isinstance(k, str) and k.lower() in LIVE_KEYS and k not in cls.model_fields]
            for key in live:
                err = spec_error(live_message(LIVE_KEYS[key.lower()]), fix=LIVE_REASON, got=got_key(key, data[key]))
                extra.append(_line((key,), err, data[key]))
            if live:
                data = {k: v for k, v in data.items() if k not in live}
        extra.extend(_line(loc, err, value) for loc, err, value in cls._rules(data))
        try:
            model = handler(data)
        except ValidationError as exc:
            if not extra:
                raise
            lines = _reinstate(exc) + extra
        else:
            if not extra:
                return model
            lines = extra
        order = {name: index for index, name in enumerate(cls.model_fields)}
        lines.sort(key=lambda line: _sort_key(line["loc"], order))
        raise ValidationError.from_exception_data(cls.__name__, lines)
