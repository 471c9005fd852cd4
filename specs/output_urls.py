"""Output and checkpoint URLs that cannot work: no bucket or host, a pattern, or a place the inputs are read from.

``output.url`` and ``output.checkpoint.url`` name one folder that files are
written into by name, so they cannot be ``http(s)://`` (fsspec's HTTP
filesystem reads only), must name a bucket or host after the protocol
(``s3://`` alone names nothing), and hold no glob character (``*``, ``?``,
``[``; a ``?query`` included: file names are appended to the path). Neither
may be, lie inside, or hold a ``data[].url``: the job would write into its
own inputs. Places are compared after normalising: a trailing ``/``,
``file://`` against a plain path (its path percent-decoded), ``.``/``..`` in local paths, the last part
of an fsspec ``a::b`` chain, a glob input by the folder before its wildcard.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator

from .base import RuleError, spec_error
from .errors import format_loc, short_repr
from .fields import Url
from .urls import file_url_path, mask_url

__all__ = ["GLOB_CHARS", "OutputUrl", "check_output_url", "overlap_problems"]

#: Characters fsspec expands as a pattern.
GLOB_CHARS = "*?["
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_LOCAL = ("file", "local")
_HOSTLESS = (*_LOCAL, "memory")  # protocols whose URLs name no bucket or host
_ALIASES = {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az", "local": "file"}
_WEB = ("http", "https")


def _split(part: str) -> tuple[str, str]:
    """(protocol in lower case or "", the rest without user info) of one part of a URL."""
    match = _SCHEME.match(part)
    if not match:
        return "", part
    rest = part[match.end():]
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority:  # "token@host" or a masked "***@host": not part of the place
        rest = rest[authority.rindex("@") + 1:]
    return match.group(1).lower(), rest


#: fsspec protocols whose filesystems only read (archives, repositories, inline data).
_READ_ONLY = ("zip", "tar", "libarchive", "github", "gist", "git", "data", "reference", "jlab", "jupyter")
#: Local folders of the system itself: never an output destination.
_SYSTEM = ("/proc", "/sys", "/dev", "/etc", "/boot", "/bin", "/sbin", "/usr", "/lib", "/lib32", "/lib64", "/run")


def _realpath(path: str) -> str:
    """``path`` (``~`` expanded) with symbolic links resolved where they exist; a path holding a NUL
    byte, which no file system takes (its field's own check refuses it), only normalised."""
    path = os.path.expanduser(path)
    return os.path.normpath(os.path.abspath(path)) if "\x00" in path else os.path.realpath(path)


def _problem(url: str) -> Any:
    """The refusal of an output URL that cannot work, or None."""
    got = short_repr(mask_url(url))
    last_protocol, last_rest = _split(url.split("::")[-1])
    last_rest = _decoded(url.split("::")[-1], last_rest)
    if last_protocol in ("", *_LOCAL) and last_rest.strip():
        place = _realpath(last_rest)
        system = next((d for d in _SYSTEM if place == d or place.startswith(d + "/")), None)
        if place == "/" or system:
            return spec_error(f"must not be {'the root folder' if place == '/' else f'a system folder ({system})'}: "
                              "E31 writes and removes files there", got=got,
                              fix="give a folder of the job's own, e.g. /srv/results/NAME/ or ~/results/NAME/")
    for part in url.split("::"):
        protocol, rest = _split(part)
        if protocol in _READ_ONLY:
            return spec_error(f"cannot be written to: fsspec's {protocol}:// filesystem only reads", got=got,
                              fix="return to a folder or an object store (s3://, gs://, az://)")
        if protocol in _WEB:
            return spec_error(
                f"cannot be written to: fsspec's {protocol}:// filesystem only reads", got=got,
                fix="return to an object store (s3://, gs://, az://) or a folder, and serve the files over HTTP from there",
            )
        if protocol and not rest.strip("/"):
            what = "a folder" if protocol in _HOSTLESS else "a bucket or host"
            example = "file:///srv/results/NAME/" if protocol in _LOCAL else f"{protocol}://my-bucket/results/NAME/"
            return spec_error(f"must name {what} after '{protocol}://'", fix=f"e.g. {example}", got=got)
        if protocol and protocol not in _HOSTLESS and not re.split(r"[/?#]", rest, maxsplit=1)[0]:
            return spec_error(f"must name a bucket or host after '{protocol}://'",
                              fix=f"e.g. {protocol}://my-bucket/results/NAME/", got=got)
        if any(char in rest for char in GLOB_CHARS):
            return spec_error(
                "must name one folder, not a pattern: '*', '?' and '[' are glob characters", got=got,
                fix="remove them; files are written into this folder by name, so it cannot hold a wildcard or a ?query",
            )
    return None


def check_output_url(value: str) -> str:
    """Refuse an output or checkpoint URL that cannot work (see the module
    docstring): no bucket or host after the protocol, or a glob character.
    Returns ``value``; raises a pydantic error naming the fix (the URL shown masked)."""
    error = _problem(value)
    if error is not None:
        raise error
    return value


#: A :data:`e31.specs.fields.Url` that can be written to: one folder, with a bucket or host.
OutputUrl = Annotated[Url, AfterValidator(check_output_url)]


def _decoded(part: str, rest: str) -> str:
    """``rest`` of one URL part, percent-decoded when the part is a ``file://`` URL (as it is staged and written)."""
    local = file_url_path(part)
    return rest if local is None else local


def _place(url: str) -> tuple[str, str]:
    """(protocol, path) of the place ``url`` reads or writes, normalised for comparing."""
    protocol, rest = _split(url.split("::")[-1])
    rest = _decoded(url.split("::")[-1], rest)
    protocol = _ALIASES.get(protocol, protocol)
    if protocol in _WEB:
        rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    wildcard = min((rest.find(c) for c in GLOB_CHARS if c in rest), default=-1)
    if wildcard >= 0:  # a glob input: the folder before its wildcard
        rest = rest[: rest.rfind("/", 0, wildcard) + 1]
    if protocol in ("", "file"):
        return "", _realpath(rest or ".")  # symbolic links resolved where they exist
    return protocol, (rest.lstrip("/") if protocol == "memory" else rest).rstrip("/")


def _within(inner: tuple[str, str], outer: tuple[str, str]) -> bool:
    return inner[0] == outer[0] and (inner[1] == outer[1] or inner[1].startswith(outer[1].rstrip("/") + "/"))


def _overlap(url: str, data_urls: list[tuple[int, str]]) -> str | None:
    """How ``url`` overlaps the first input it does (``the same place as data[0].url``...), or None."""
    place = _place(url)
    for index, data_url in data_urls:
        other = _place(data_url)
        if place == other:
            return f"the same place as data[{index}].url"
        if _within(place, other):
            return f"a folder inside data[{index}].url"
        if _within(other, place):
            return f"a folder that holds data[{index}].url"
    return None


def _get(item: Any, key: str) -> Any:
    return item.get(key) if isinstance(item, Mapping) else getattr(item, key, None)


def overlap_problems(data: Mapping[str, Any]) -> list[RuleError]:
    """Problems at ``output.url`` and ``output.checkpoint.url`` in raw JobSpec input ``data``
    where the URL is, lies inside, or holds a ``data[].url`` (the first such input is named).
    Values that are not strings, and URLs refused for another reason, are left to their own checks."""
    inputs = data.get("data")
    data_urls = [(index, url) for index, item in enumerate(inputs if isinstance(inputs, list) else [])
                 if isinstance(url := _get(item, "url"), str) and url.strip()]
    output = data.get("output")
    checkpoint = _get(output, "checkpoint")
    problems: list[RuleError] = []
    for loc, url in ((("output", "url"), _get(output, "url")), (("output", "checkpoint", "url"), _get(checkpoint, "url"))):
        if not isinstance(url, str) or not url.strip() or _problem(url) is not None:
            continue
        how = _overlap(url, data_urls)
        if how:
            err = spec_error("must not overlap an input: the job would write into its own inputs", got=how,
                             fix=f"give {format_loc(loc)} a folder of its own, outside every input")
            problems.append((loc, err, url))
    out_url, ck_url = _get(output, "url"), _get(checkpoint, "url")
    if isinstance(out_url, str) and isinstance(ck_url, str) and out_url.strip() and ck_url.strip() \
            and _problem(out_url) is None and _problem(ck_url) is None:
        out, ck = _place(out_url), _place(ck_url)
        partial = (out[0], out[1].rstrip("/") + "/partial")
        if ck == out or _within(ck, partial):
            where = "the output folder itself" if ck == out else "inside the output's partial/ folder"
            err = spec_error(f"must not be {where}: E31 replaces the files there on every return", got=ck_url,
                             fix="use a folder of its own, e.g. <output.url>/checkpoints (the default)")
            problems.append((("output", "checkpoint", "url"), err, ck_url))
    return problems
