"""URL helpers: masking credentials for logs, and resolving relative local paths."""

from __future__ import annotations

import os
import re
from urllib.parse import unquote

__all__ = ["SECRET_QUERY_KEYS", "SECRET_URL_PATTERN", "file_url_path", "has_protocol", "mask_url", "quote_for_file_url",
           "resolve_path"]

#: Query parameters whose values are masked (compared case-insensitively).
SECRET_QUERY_KEYS = frozenset({
    "x-amz-signature", "x-amz-credential", "x-amz-security-token",
    "x-goog-signature", "x-goog-credential",
    "sig", "signature", "token", "access_token", "refresh_token", "id_token",
    "key", "api_key", "apikey", "secret", "client_secret", "password", "passwd", "pwd",
})

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_CHAIN = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*::")
_MASK = "***"


# query parameters whose name contains one of these are masked too (e.g. secret_access_key)
_SECRET_WORDS = ("secret", "token", "password", "passwd", "signature", "credential", "apikey", "api_key", "access_key")


def _ci(word: str) -> str:
    """``word`` as a case-insensitive regular expression without flags
    (JSON Schema patterns take none)."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in word)


#: A JSON Schema pattern (Python and JavaScript alike) found in a URL that
#: carries a credential :func:`mask_url` would hide: user info before a
#: host (``s3://KEY:SECRET@bucket``, ``https://token@host``) or a
#: secret-looking query parameter (``X-Amz-Signature=``, ``sig=``...).
SECRET_URL_PATTERN = (
    r"(?:^|::)[A-Za-z][A-Za-z0-9+.-]*://(?:[^/?#@]*@|[^/?#@:]+:(?![0-9]*(?:/|$))[^?#@]*@)"
    r"|[?&](?:" + "|".join(_ci(k) for k in sorted(SECRET_QUERY_KEYS)) + r")="
    r"|[?&][^=&#]*(?:" + "|".join(_ci(w) for w in _SECRET_WORDS) + r")[^=&#]*="
)


def _mask_userinfo(url: str) -> str:
    match = _SCHEME.match(url)
    if not match:
        return url
    head, rest = url[: match.end()], url[match.end():]
    at = rest.find("@")
    if at < 0:
        return url
    slash = rest.find("/", at)  # a password may hold '@' too: the user info ends at the host's, the last one
    at = rest[:slash if slash >= 0 else len(rest)].rfind("@")
    before = rest[:at]
    authority = before.split("/", 1)[0]
    if "/" in before:
        # "host:8080/path/@x" is a path containing "@"; "KEY:SEC/RET@bucket" is a secret with "/".
        user, colon, port = authority.partition(":")
        if not colon or port.isdigit() or not user:
            return url
    return head + _MASK + rest[at:]


def _mask_query(url: str) -> str:
    base, qmark, rest = url.partition("?")
    if not qmark:
        return url
    query, hash_, fragment = rest.partition("#")
    parts = []
    for item in query.split("&"):
        key, eq, _value = item.partition("=")
        name = unquote(key).strip().lower()
        if eq and (name in SECRET_QUERY_KEYS or any(word in name for word in _SECRET_WORDS)):
            item = f"{key}={_MASK}"
        parts.append(item)
    return base + qmark + "&".join(parts) + hash_ + fragment


def mask_url(url: str) -> str:
    """Mask credentials in a URL before it is logged or shown.

    User info becomes ``***`` (``s3://KEY:SECRET@bucket/x`` ->
    ``s3://***@bucket/x``) and secret-looking query values become ``***``
    (``X-Amz-Signature``, ``X-Amz-Credential``, ``sig``, ``signature``,
    ``token``, ``access_token``, ``key``, ``secret``, ``password`` and a few
    more, case-insensitive). Each part of an fsspec ``a::b`` chain is masked.
    Plain paths are returned unchanged. Never raises for a string.
    """
    if not isinstance(url, str):
        return url
    return "::".join(_mask_query(_mask_userinfo(part)) for part in url.split("::"))


def has_protocol(url: str) -> bool:
    """True for URLs with a protocol: ``scheme://...`` or an fsspec chain ``proto::...``."""
    return bool(_SCHEME.match(url) or _CHAIN.match(url))


def resolve_path(url: str, base_dir: str | os.PathLike[str] | None) -> str:
    """Make a local relative path absolute against ``base_dir``; expand ``~``.

    URLs with a protocol and absolute paths are returned as given; a trailing
    slash is kept. With ``base_dir`` None, relative paths are returned as
    given (after ``~`` expansion).
    """
    if not isinstance(url, str) or not url.strip() or has_protocol(url):
        return url
    if url[:6].lower() == "file:/":  # RFC 8089's one-slash form, file:/p: a URL, not a relative name
        return "file://" + url[len("file:"):]
    path = os.path.expanduser(url) if url.startswith("~") else url
    if os.path.isabs(path):
        return path
    if base_dir is None:
        return path
    resolved = os.path.abspath(os.path.join(os.fspath(base_dir), path))
    if url.endswith(("/", os.sep)) and not resolved.endswith(os.sep):
        resolved += os.sep
    return resolved


_FILE_URL = re.compile(r"^file://", re.IGNORECASE)


def file_url_path(url: str) -> str | None:
    """The local path a ``file://`` URL names, percent-decoded; None when
    ``url`` is not a ``file://`` URL.

    RFC 8089 (section 2) builds a file URL's path from RFC 3986 segments, in
    which a character outside the unreserved set is written ``%XX`` (RFC 3986
    section 2.1): ``file:///data/my%20data.csv`` names ``/data/my data.csv``.
    The octets are decoded as UTF-8 (RFC 3986 section 2.5), bytes that are not
    UTF-8 kept as ``os.fsdecode`` keeps them, so the path reaches the same
    file.  ``file://localhost/p`` is ``/p`` (RFC 8089 section 2: "localhost"
    is this machine).  Any other text after ``file://`` is kept as fsspec
    reads it (``file://data/x`` is the relative path ``data/x``).  A ``?`` or
    ``#`` is part of the path, as fsspec's local filesystem takes it.  A plain
    path (no ``file://``) is a name, not a URL, and is never decoded: this
    returns None for it.
    """
    if not isinstance(url, str) or not _FILE_URL.match(url):
        return None
    rest = url[len("file://"):]
    if rest[: len("localhost/")].lower() == "localhost/":
        rest = rest[len("localhost"):]
    return unquote(rest, encoding="utf-8", errors="surrogateescape")


def quote_for_file_url(name: str) -> str:
    """``name`` (a relative path) made safe to append to a ``file://`` URL:
    ``%`` becomes ``%25``, so that :func:`file_url_path` gives the name back
    exactly (``100%.txt``, ``a%20b`` stay as they are on disk)."""
    return name.replace("%", "%25")
