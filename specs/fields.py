"""Field types of the spec models: durations, memory, names, paths; each with E31 messages."""

from __future__ import annotations

import json
import keyword
import posixpath
import re
import unicodedata
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, PlainSerializer, SerializationInfo, WithJsonSchema

from .base import spec_error
from .deadlines import Deadline, check_deadline  # re-exported: absolute deadlines live with the others
from .quantities import MAX_URL, Duration, Grace, Memory
from .urls import SECRET_URL_PATTERN, file_url_path, mask_url

__all__ = [
    "Deadline", "Duration", "FileName", "GpuType", "Grace", "InputName", "JobName", "Memory", "NonEmpty",
    "REVEAL_SECRETS", "Sha256", "Url", "check_deadline", "check_entrypoint", "check_json", "file_key", "input_key",
    "has_password", "password_error", "SAFE_NAME", "valid_job_name",
]

SAFE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_SAFE = re.compile(SAFE_NAME)


def valid_job_name(name: str) -> bool:
    """True for a job name a spec may give (1-63 letters, digits, ``.``,
    ``_``, ``-``, starting with a letter or digit): never a path."""
    return len(name) <= 63 and _SAFE.fullmatch(name) is not None
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")



def _nonempty(value: Any) -> Any:
    if isinstance(value, str) and not value.strip():
        raise spec_error("must be a non-empty URL or path")
    return value


#: A non-empty string.
NonEmpty = Annotated[str, AfterValidator(_nonempty), WithJsonSchema({"type": "string", "minLength": 1})]

_PASSWORD_IN_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@?#]*:[^/@?#]*@")

#: Serialisation context key: ``model_dump(mode="json", context={REVEAL_SECRETS: True})`` keeps real URLs.
REVEAL_SECRETS = "reveal_secrets"


def has_password(value: str) -> bool:
    """True for a URL (or any part of an fsspec ``a::b`` chain) with ``user:password@``."""
    return any(_PASSWORD_IN_URL.match(part) for part in value.split("::"))


def password_error():
    """The refusal of a URL that carries a password (the password is never shown)."""
    return spec_error(
        "must not carry a password: specs are stored and shown (Prefect parameters, logs)",
        fix="put credentials in environment variables (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) "
        "or a Prefect Secret block, and give the URL without them",
        got="a URL with user:password@",
    )


_FILE_ONE_SLASH = re.compile(r"^file:/(?!/)", re.IGNORECASE)
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def _file_url(value: str) -> str:
    """A ``file:`` URL as RFC 8089 writes it: ``file:/p`` (section 2, the one-slash form) is ``file:///p``;
    the host must be empty or ``localhost`` (a file URL with another host names a file on that host, which
    E31 does not reach); every ``%`` starts an escape of two hex digits (RFC 3986 section 2.1)."""
    if _FILE_ONE_SLASH.match(value):
        value = "file://" + value[len("file:"):]
    if file_url_path(value) is None:
        return value
    host = value[len("file://"):].split("/", 1)[0]
    if host and host.lower() != "localhost":
        raise spec_error("a file:// URL names a file on this machine: its host must be empty or localhost",
                         fix=f"write file:///{value[len('file://'):]} (three slashes) for an absolute path, or a "
                             "plain path; for another machine's files use a protocol it serves (s3://, http://, ...)",
                         got=f"host {host!r}")
    bad = _BAD_ESCAPE.search(value)
    if bad:
        raise spec_error("a % in a file:// URL must start an escape of two hex digits (RFC 3986)",
                         fix="write %25 for a literal %, or give a plain path",
                         got=f"{value[bad.start():bad.start() + 3]!r} at character {bad.start() + 1}")
    return value


def _url(value: str) -> str:
    _nonempty(value)
    _text(value)
    _visible(value)
    value = _file_url(value)
    local = file_url_path(value)
    if local is not None:  # the path a file:// URL names once decoded (%0A is a line break)
        _visible(local, " of its decoded path")
    if len(value) > MAX_URL:
        raise spec_error(f"must be at most {MAX_URL} characters", got=f"{len(value)} characters")
    if has_password(value):
        raise password_error()
    return value


def _text(value: str) -> str:
    """Refuse text that cannot be written as UTF-8 (a lone surrogate): no
    file system or store could take it as a name."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise spec_error("must be valid Unicode text", got=f"a lone surrogate {value[exc.start]!a} at character "
                         f"{exc.start + 1}") from None
    return value


#: Bidirectional formatting characters (Unicode UAX #9: LRM, RLM, ALM, the embeddings, overrides and
#: isolates), the set flagged by CVE-2021-42574 ("Trojan Source"): they make text display in another order.
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _visible(value: str, where: str = "") -> str:
    """Refuse control characters (Unicode category Cc: C0, DEL, C1) and
    bidirectional formatting characters: a name holding them shows
    differently from what it is (a line break splits it, U+202E reverses
    what follows), in logs, manifests and the UI alike."""
    for index, char in enumerate(value):
        if unicodedata.category(char) == "Cc" or char in _BIDI:
            name = unicodedata.name(char, "") or "a control character"
            raise spec_error("must not hold control characters or bidirectional-text controls: a name holding "
                             "them shows differently from what it is",
                             fix="remove it and write the name with visible characters only",
                             got=f"U+{ord(char):04X} ({name}) at character {index + 1}{where}")
    return value


def _serialize_url(value: str, info: SerializationInfo) -> str:
    """JSON dumps (Prefect's stored parameters) get the masked URL unless the context reveals secrets."""
    context = info.context if isinstance(info.context, Mapping) else {}
    if info.mode_is_json() and not context.get(REVEAL_SECRETS):
        return mask_url(value)
    return value


#: A non-empty fsspec URL or path without an embedded password; masked (:func:`e31.specs.mask_url`)
#: in JSON-mode dumps unless the serialisation context has ``reveal_secrets: True``.
Url = Annotated[
    str,
    AfterValidator(_url),
    PlainSerializer(_serialize_url, return_type=str),
    # a URL carrying a credential is refused by the schema too: a Prefect server checks a deployment run's
    # parameters against it before storing them
    WithJsonSchema({"type": "string", "minLength": 1, "not": {"pattern": SECRET_URL_PATTERN}}),
]


def _job_name(value: str) -> str:
    if not (1 <= len(value) <= 63 and _SAFE.match(value)):
        raise spec_error(
            "must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit",
            fix="it names the run and its folder, e.g. digits-nightly-retrain",
        )
    return value


#: A job name safe as a folder and Prefect run name.
JobName = Annotated[
    str,
    AfterValidator(_job_name),
    WithJsonSchema({"type": "string", "pattern": SAFE_NAME, "minLength": 1, "maxLength": 63}),
]


def _gpu_type(value: str) -> str:
    if not (len(value) <= 63 and _SAFE.match(value)):
        raise spec_error("must be 1 to 63 letters, digits, '.', '_' or '-', e.g. H100", fix="name a GPU model")
    return value


#: A GPU model name such as ``H100`` or ``A100-80GB``; the planner matches it case-insensitively.
GpuType = Annotated[str, AfterValidator(_gpu_type), WithJsonSchema({"type": "string", "pattern": SAFE_NAME})]


def _input_name(value: str) -> str:
    if not (len(value) <= 255 and _SAFE.match(value)) or value in (".", ".."):
        raise spec_error(
            "must be letters, digits, '.', '_' or '-', starting with a letter or digit",
            fix="it names the input's folder, e.g. digits",
        )
    return value


#: A data input name safe as a folder name.
InputName = Annotated[
    str,
    AfterValidator(_input_name),
    WithJsonSchema({"type": "string", "pattern": SAFE_NAME, "minLength": 1, "maxLength": 255}),
]


def _sha256(value: str) -> str:
    if not _SHA256.fullmatch(value):
        raise spec_error("must be 64 hexadecimal characters", fix="compute it with: sha256sum FILE")
    return value.lower()


#: A SHA-256 digest, normalised to lower case.
Sha256 = Annotated[
    str, AfterValidator(_sha256), WithJsonSchema({"type": "string", "pattern": "^[0-9a-fA-F]{64}$"})
]


def _file_name(value: str) -> str:
    fix = "write it relative to the output folder, e.g. model.pt or plots/loss.png"
    _text(value)
    _visible(value)
    if len(value) > MAX_URL:
        raise spec_error(f"must be at most {MAX_URL} characters", got=f"{len(value)} characters")
    if not value.strip():
        raise spec_error("must be a non-empty relative path", fix=fix)
    if value.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", value):
        raise spec_error("must be a relative path inside the output, not absolute", fix=fix)
    if ".." in re.split(r"[/\\]", value):
        raise spec_error("must stay inside the output: '..' is not allowed", fix=fix)
    if "\\" in value:
        raise spec_error("must use '/' as the separator (a POSIX path)", fix=fix)
    if value.endswith("/"):
        raise spec_error("must name a file, not a folder", fix="list a file that the work writes inside it, e.g. plots/loss.png")
    if posixpath.normpath(value) == ".":
        raise spec_error("must name a file, not the output folder itself", fix=fix)
    if posixpath.normpath(value) == "manifest.json":
        raise spec_error("manifest.json is written by E31 itself", fix="give the work's file another name, e.g. results.json")
    return value


#: A relative POSIX path of an output file, inside the output folder.
FileName = Annotated[str, AfterValidator(_file_name), WithJsonSchema({"type": "string", "minLength": 1})]


def file_key(value: object) -> str | None:
    """Normalised form of a valid output file path, to find duplicates (``./a`` == ``a``).

    None for a value that is not a valid file path (it gets its own problem).
    """
    if not isinstance(value, str):
        return None
    try:
        _file_name(value)
    except ValueError:
        return None
    return posixpath.normpath(value)


def input_key(value: object) -> str | None:
    """A data input name as validated (numbers become strings), or None if it is not valid."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        return None
    try:
        return _input_name(value)
    except ValueError:
        return None


_PARAMS_FIX = "the work receives params as JSON; write other values out as strings"


def check_json(value: Any, fix: str = _PARAMS_FIX) -> Any:
    """Refuse values that are not plain JSON (bytes, NaN, infinities): the
    work receives ``params`` as JSON. ``fix`` says why JSON is needed and what to do."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        got = "a NaN or infinite number" if isinstance(exc, ValueError) else str(exc).split(" is not")[0].replace("Object of type ", "")
        raise spec_error(
            "must hold JSON values only (strings, numbers, booleans, null, lists, mappings)",
            fix=fix,
            got=got,
        ) from None
    return value


def check_entrypoint(value: str) -> str:
    """Check ``module:function`` with dotted Python identifiers on both sides."""
    module, sep, function = value.partition(":")
    ok = bool(sep) and all(
        part.isidentifier() and not keyword.iskeyword(part)
        for side in (module, function)
        for part in side.split(".")
    )
    if not ok:
        fix = "e.g. e31.examples.digits:train"
        if "/" in value or value.endswith(".py") or ".py:" in value:
            fix = "use the module's import name, not a file path, e.g. e31.examples.digits:train"
        raise spec_error("must be 'module:function' with dotted Python names on both sides", fix=fix)
    return value
