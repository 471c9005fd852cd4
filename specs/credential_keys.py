"""Credential-looking names: the storage option keys and HTTP header names whose values are secrets.

Names are compared normalised: lower case, without ``_``, ``-`` or spaces, so
``access_key``, ``accessKey``, ``Access-Key`` and ``ACCESSKEY`` are one name.
"""

from __future__ import annotations

import re

__all__ = [
    "CREDENTIAL_KEYS", "CREDENTIAL_WORDS", "HEADER_WORDS", "PATH_SUFFIXES", "TOKEN_MODES", "is_auth_mode",
    "is_credential_header", "is_credential_key", "is_headers_key", "normalise_name",
]

#: A normalised key containing one of these holds a credential.
CREDENTIAL_WORDS = (
    "secret", "password", "passwd", "token", "credential", "accountkey", "accesskey", "apikey", "privatekey",
    "connectionstring", "customerkey", "encryptionkey", "authorization", "cookie", "passphrase", "bearer",
)
#: A normalised key equal to one of these holds a credential.
CREDENTIAL_KEYS = frozenset({"key", "sas", "auth", "pwd", "pkey", "jwt"})
#: A normalised key ending in one of these names a file holding a credential, not the credential.
PATH_SUFFIXES = ("file", "filename", "path")
#: gcsfs's ``token`` modes that name a way to authenticate, not a secret (gcsfs documentation).
TOKEN_MODES = frozenset({"anon", "google_default", "cache", "cloud", "browser"})
#: A normalised HTTP header name (a key under ``headers``) containing one of these holds a credential.
HEADER_WORDS = ("auth", "token", "key", "secret", "cookie", "password", "passwd", "credential")

_SEPARATORS = re.compile(r"[\s_-]+")


def normalise_name(name: str) -> str:
    """``name`` in lower case without ``_``, ``-`` or whitespace: ``X-Api-Key`` -> ``xapikey``."""
    return _SEPARATORS.sub("", name).lower()


def is_credential_key(key: object) -> bool:
    """True for an option key that names a credential, compared normalised (:func:`normalise_name`):
    one containing secret, password, passwd, token, credential, account_key, access_key, api_key,
    private_key, connection_string, customer_key, encryption_key, authorization, cookie, passphrase
    or bearer, or exactly key, sas, auth, pwd, pkey or jwt (so ``secret_access_key``, ``accessKey``,
    ``api-key``, ``sas_token`` and ``aws_access_key_id`` are credentials; ``key_prefix``,
    ``endpoint_url`` and names ending in file or path, such as ``token_file``, are not).
    False for non-strings."""
    if not isinstance(key, str):
        return False
    name = normalise_name(key)
    if name.endswith(PATH_SUFFIXES):  # token_file, credentials_path: where the secret is, not the secret
        return False
    return name in CREDENTIAL_KEYS or any(word in name for word in CREDENTIAL_WORDS)


def is_auth_mode(key: object, value: object) -> bool:
    """True for a literal that names how to authenticate rather than holding a
    secret: gcsfs's ``token: anon`` (public buckets), ``google_default``,
    ``cache``, ``cloud`` or ``browser``."""
    return isinstance(key, str) and isinstance(value, str) and normalise_name(key) == "token" and value in TOKEN_MODES


def is_credential_header(name: object) -> bool:
    """True for an HTTP header name whose value is a credential: a credential key
    (:func:`is_credential_key`) or one whose normalised name contains auth, token,
    key, secret, cookie, password, passwd or credential (``Authorization``,
    ``Proxy-Authorization``, ``Cookie``, ``X-Api-Key``, ``X-Auth-Token``,
    ``X-Amz-Security-Token``). False for non-strings."""
    if not isinstance(name, str):
        return False
    return is_credential_key(name) or any(word in normalise_name(name) for word in HEADER_WORDS)


def is_headers_key(key: object) -> bool:
    """True for an option key that holds HTTP headers: ``headers``, ``header`` or a
    name ending in headers (``default_headers``, ``extra-headers``), normalised."""
    return isinstance(key, str) and (normalise_name(key) == "header" or normalise_name(key).endswith("headers"))
