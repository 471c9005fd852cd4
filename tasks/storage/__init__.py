"""The storage layer: every fsspec call E31 makes goes through this package.

| module | what it does |
|---|---|
| :mod:`.filesystems` | ``filesystem(url)`` with the URL's registered storage options; join, exists, list, read, remove |
| :mod:`.publish` | ``get`` (down) and ``publish_file`` / ``write_bytes`` (up): whole objects only, verified |
| :mod:`.local` | local-disk helpers: sha256, walking an output folder, fsync |
| :mod:`.masking` | ``scrub``: credentials masked in any text E31 stores or shows |
| :mod:`.options` | resolve and register a spec's ``storage_options`` for this process |
| :mod:`.credentials` | ``{env: VAR}`` / ``{secret: BLOCK}`` references resolved on the worker |
| :mod:`.listing` | list an input (file, folder, glob) before staging: sizes, ETags, mtimes |
| :mod:`.transfer` | copy a listed input to scratch (parallel, verified, resumable) |
| :mod:`.etag` | S3-style MD5 ETags, single- and multipart |
| :mod:`.s3session` | a faster botocore timestamp parser for s3fs |
| :mod:`.progress` | transfer progress: a terminal bar and a Prefect progress artifact |

The common verbs are re-exported here (``from e31.tasks import storage;
storage.publish_file(...)``).
"""

from e31.tasks.storage.filesystems import (backend_problem, exists, filesystem, is_local, join, list_dirs, protocols,
                                          read_bytes, remove, remove_file, use_options)
from e31.tasks.storage.local import CHUNK, VerifyError, fsync_path, sha256_file, walk_files
from e31.tasks.storage.masking import describe_error, remember_secret, scrub
from e31.tasks.storage.publish import ATOMIC_PROTOCOLS, get, publish_file, write_bytes

__all__ = [
    "ATOMIC_PROTOCOLS", "CHUNK", "VerifyError", "backend_problem", "describe_error", "exists", "filesystem", "fsync_path", "get",
    "is_local", "join", "list_dirs", "protocols", "publish_file", "read_bytes", "remember_secret", "remove", "remove_file", "scrub",
    "sha256_file", "use_options", "walk_files", "write_bytes",
]
