"""The common model base: strict config, custom errors, and rules that never hide field errors.

Cross-field rules (``duration <= limit``, ``entrypoint`` xor ``command``...)
run on the raw input in a wrap validator, so they are reported together with
field errors of the same model instead of only after every field is valid.

A model built from Python (``JobSpec(...)``, ``JobSpec.model_validate(...)``,
``model_validate_json``, ``model_validate_strings``) raises the same
:class:`e31.specs.SpecError` as :func:`e31.specs.load_spec` does for the same
mistake. Inside pydantic (a spec nested in another model, or a Prefect flow
parameter checked by Prefect) validation still raises pydantic's
``ValidationError``, which those callers expect.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from .live import LIVE_KEYS, LIVE_REASON, got_key, live_message
from .nesting import nesting_message, too_deep

if TYPE_CHECKING:
    from .errors import SpecError

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


def _submodel(model: type[BaseModel], key: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the spec model field ``key`` of ``model`` holds or None, whether it holds a list of them)."""
    field = model.model_fields.get(key) if isinstance(key, str) else None
    if field is None:
        return None, False
    annotation = field.annotation
    for kind in (annotation, *get_args(annotation)):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind, kind is not annotation and getattr(annotation, "__origin__", None) is list
    return None, False


def _field_of(model: type[BaseModel], loc: tuple) -> tuple:
    """``loc`` cut after the first key that is not a spec model (the free-form or unknown field holding it)."""
    out: list[Any] = []
    current: type[BaseModel] | None = model
    rest = list(loc)
    while rest and current is not None:
        key = rest.pop(0)
        out.append(key)
        current, is_list = _submodel(current, key)
        if current is not None and is_list and rest and isinstance(rest[0], int):
            out.append(rest.pop(0))
    return tuple(out)


class SpecModel(BaseModel):
    """Base of all spec models: unknown fields forbidden, numbers accepted for strings.

    Subclasses may set ``live_keys_refused`` to refuse live-work keys
    (``port``, ``latency``...) with a reason instead of "unknown field", and
    override :meth:`_rules` for cross-field checks on the raw input.
    """

    # hide_input_in_errors: a ValidationError (a spec nested in another model, a Prefect flow parameter) never
    # quotes the input, which may be a URL with a password; E31's own messages (SpecError) show inputs masked
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, hide_input_in_errors=True)

    live_keys_refused: ClassVar[bool] = False

    def __init__(self, /, **data: Any) -> None:
        """Validate ``data`` into this model.

        Raises:
            SpecError: every problem at once, as :func:`e31.specs.load_spec`
                words them (not pydantic's ``ValidationError``).
        """
        __tracebackhide__ = True
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise type(self)._spec_error(exc) from None

    # pydantic calls a model's own __init__ when it validates the model nested in another one (or as a flow
    # parameter) unless the __init__ is marked as the base one: marked, nested validation stays pydantic's,
    # and only the outermost call turns its ValidationError into a SpecError
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any):
        """pydantic's ``model_validate``; raises :class:`SpecError` instead of ``ValidationError``."""
        __tracebackhide__ = True
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise cls._spec_error(exc) from None

    @classmethod
    def model_validate_json(cls, json_data: Any, **kwargs: Any):
        """pydantic's ``model_validate_json``; raises :class:`SpecError` instead of ``ValidationError``."""
        __tracebackhide__ = True
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as exc:
            raise cls._spec_error(exc) from None

    @classmethod
    def model_validate_strings(cls, obj: Any, **kwargs: Any):
        """pydantic's ``model_validate_strings``; raises :class:`SpecError` instead of ``ValidationError``."""
        __tracebackhide__ = True
        try:
            return super().model_validate_strings(obj, **kwargs)
        except ValidationError as exc:
            raise cls._spec_error(exc) from None

    @classmethod
    def _spec_error(cls, exc: ValidationError) -> SpecError:
        from .friendly import spec_error_from  # friendly imports the models built on this base

        return spec_error_from(cls, exc)

    @classmethod
    def nesting_problem(cls, data: Any) -> tuple[tuple, PydanticCustomError] | None:
        """``(field location, error)`` when raw input ``data`` nests mappings and lists more than
        :data:`e31.specs.nesting.MAX_NESTING` levels deep, else None.

        The location names the field that holds the deep value (``work.params``,
        ``data[0].storage_options``, an unknown top-level key), not the deep key itself."""
        loc = too_deep(data)
        return None if loc is None else cls.nesting_at(loc)

    @classmethod
    def nesting_at(cls, loc: tuple) -> tuple[tuple, PydanticCustomError]:
        """``(field location, error)`` for a value nested too deeply at raw location ``loc``."""
        message, got, fix = nesting_message()
        return _field_of(cls, loc), spec_error(message, fix=fix, got=got)

    @classmethod
    def _rules(cls, data: Mapping[str, Any]) -> list[RuleError]:
        """Cross-field problems in raw input ``data``; locations are relative to the model."""
        return []

    @model_validator(mode="wrap")
    @classmethod
    def _validate_all(cls, data: Any, handler):
        if not isinstance(data, Mapping):
            return handler(data)
        deep = cls.nesting_problem(data)
        if deep is not None:  # nothing below is walked: copying, printing or dumping it would recurse too deep
            raise ValidationError.from_exception_data(cls.__name__, [_line(deep[0], deep[1], None)])
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
