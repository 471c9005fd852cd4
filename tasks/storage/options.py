"""Register each declared URL's fsspec storage options for this process.

A spec may give ``storage_options`` for an input, the output and the
checkpoint folder; secret references in them (``{secret: BLOCK}``,
``{env: VAR}``) are resolved here, on the worker, and the resolved options
are kept only in memory by :func:`e31.tasks.storage.use_options`: they never
reach Prefect parameters, logs or files.
"""

from __future__ import annotations

from typing import Any

from e31.tasks import storage


def register_storage(spec: Any, plan: Any) -> None:
    """Resolve and register the storage options of the output
    (``plan.output_url``), the checkpoint folder (``plan.checkpoint_url``)
    and every input (:func:`register_destination`, then
    :func:`register_inputs`).  Raises ``e31.tasks.storage.credentials.CredentialError``
    naming the field when a referenced Secret block or environment variable
    is missing."""
    register_destination(spec, plan)
    register_inputs(spec)


def register_inputs(spec: Any) -> None:
    """Resolve and register the storage options of every ``data[]`` input;
    raises ``CredentialError`` naming the first field that cannot be."""
    from e31.tasks.storage.credentials import resolve_options

    for index, item in enumerate(spec.data):
        options = getattr(item, "storage_options", None)
        if options:
            storage.use_options(item.url, resolve_options(options, f"data[{index}].storage_options"))


def register_destination(spec: Any, plan: Any) -> None:
    """Resolve and register the storage options of the output and the
    checkpoint folder; raises ``CredentialError`` naming the field."""
    from e31.tasks.storage.credentials import resolve_options

    out = getattr(spec.output, "storage_options", None)
    if out:
        storage.use_options(plan.output_url, resolve_options(out, "output.storage_options"))
        storage.use_options(plan.checkpoint_url, resolve_options(out, "output.storage_options"))
    ckpt = getattr(spec.output.checkpoint, "storage_options", None)
    if ckpt:
        storage.use_options(plan.checkpoint_url, resolve_options(ckpt, "output.checkpoint.storage_options"))
