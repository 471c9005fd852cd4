"""Mask credentials in text E31 stores or shows: the values of registered
storage options under credential-looking keys, values read from Prefect
Secret blocks, values of credential-looking environment variables, and the
user info and signatures of every URL quoted in the text (a client's
exception often quotes the request URL)."""

from __future__ import annotations

import os
import re
import threading
from typing import Any, Iterator, Mapping

from e31.specs import is_credential_key, mask_url
from e31.specs.urls import file_url_path
from e31.tasks.storage.filesystems import registered_options

#: Environment variables whose names look like credentials but never hold one (PWD: the
#: working folder, whose name matches the "pwd" of password).
NOT_SECRET_ENV = frozenset({"PWD", "OLDPWD"})

_SECRET_VALUES: set[str] = set()  # values read from Secret blocks (scrub masks them wherever they appear)
_LOCK = threading.Lock()


def scrub(text: str) -> str:
    """``text`` with every credential of the registered storage options --
    string values under a credential-looking key (:func:`e31.specs.is_credential_key`)
    and values read from Prefect Secret blocks (:func:`remember_secret`), 6
    characters or longer -- replaced by ``***``, for error messages that may
    quote a client's request.  So are the values of environment variables
    with credential-looking names (``AWS_SECRET_ACCESS_KEY``, ``MY_TOKEN``;
    a work that prints its environment), and every URL in the text is
    masked as :func:`e31.specs.mask_url` does (user info, signature and token
    query parameters).  Endpoints, regions and other plain options stay
    readable."""
    with _LOCK:
        secrets = set(_SECRET_VALUES)
    values = {v for opts in registered_options() for v in _credentials(opts) if len(v) >= 6} | secrets
    values |= {v for name, v in os.environ.items()
               if len(v) >= 6 and name not in NOT_SECRET_ENV and is_credential_key(name)}
    for value in sorted(values, key=len, reverse=True):
        text = text.replace(value, "***")
    return _URL_IN_TEXT.sub(lambda m: mask_url(m.group(0)), text) if "://" in text else text


#: A URL quoted inside free text (up to a space, quote or bracket; punctuation that ends a sentence or a
#: clause, as in "data 'x': URL: not found", is not part of it, so masking a masked text changes nothing).
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()\[\]{}]*[^\s'\"<>()\[\]{}.,;:!?]")


def remember_secret(value: Any) -> None:
    """Have :func:`scrub` mask every string in ``value`` (a Secret block's
    value, whatever key it is used under), 6 characters or longer."""
    with _LOCK:
        _SECRET_VALUES.update(v for v in _strings(value) if len(v) >= 6)


def _credentials(options: Mapping[str, Any], under: bool = False) -> Iterator[str]:
    for key, value in options.items():
        secret = under or is_credential_key(key)
        if isinstance(value, Mapping):
            yield from _credentials(value, secret)
        elif secret:
            yield from _strings(value)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


#: Exception class names of storage clients that mean "no or incomplete credentials".
_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                   "DefaultCredentialsError", "ClientAuthenticationError")

CREDENTIALS_FIX = (
    "give the store's credentials on the machine that runs the job: for S3 and S3-compatible stores "
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), with AWS_ENDPOINT_URL for MinIO/SeaweedFS/Ceph; "
    "GCS GOOGLE_APPLICATION_CREDENTIALS; Azure AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY; or in the "
    "spec's storage_options as references, e.g. key: {env: MY_KEY_VAR}, secret: {secret: my-secret-block}")


def describe_error(exc: BaseException, url: str | None = None) -> str:
    """``Type: message`` of a storage client's error with credentials masked
    (:func:`scrub`), and the fix when it says the store has no credentials;
    for a local ``url`` whose disk is full, which disk and what is free."""
    text = f"{type(exc).__name__}: {scrub(str(exc))}"
    if type(exc).__name__ in _NO_CREDENTIALS:
        text += f"; {CREDENTIALS_FIX}"
    last = url.split("::")[-1] if url is not None else ""
    local = file_url_path(last) if "://" in last else last  # a file:// URL's path is percent-decoded
    if url is not None and isinstance(exc, OSError) and local is not None and "://" not in local:
        from pathlib import Path

        from e31.tasks.storage.local import disk_full

        full = disk_full(Path(local), fix="free space at the destination")  # if it IS full
        if full:
            text += f"; {full}"
    return text


class ScrubFilter:
    """A logging filter that masks every record with :func:`scrub` -- its
    message and its exception's text -- before any handler writes it: the
    console, a file, or the Prefect API's log (a client library's exception
    may quote a signed URL or a header)."""

    def filter(self, record) -> bool:  # noqa: A003 - logging's name
        try:
            message = record.getMessage()
        except Exception:
            return True
        masked = scrub(message)
        if masked != message:
            record.msg, record.args = masked, ()
        if record.exc_info and not record.exc_text:
            import traceback

            record.exc_text = scrub("".join(traceback.format_exception(*record.exc_info)).rstrip())
        elif record.exc_text:
            record.exc_text = scrub(record.exc_text)
        return True


#: Loggers whose handlers get :class:`ScrubFilter` (Prefect's run loggers send to the API).
_LOGGERS = ("", "prefect", "prefect._internal", "prefect.flow_runs", "prefect.task_runs", "prefect.extra",
            "prefect.workers", "e31")


def install_log_masking() -> None:
    """Put one :class:`ScrubFilter` on every handler of E31's and Prefect's
    loggers (idempotent; call once logging is configured)."""
    import logging

    for name in _LOGGERS:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, ScrubFilter) for f in handler.filters):
                handler.addFilter(ScrubFilter())
