"""E31: a queue for batch compute.

A job declares its **work**, **data**, **request** and **output**
(:class:`JobSpec`, loaded with :func:`load_spec`) and runs as the Prefect flow
:func:`run_job`: stage -> run -> checkpoint -> return.  The work, a Python
function, receives a :class:`WorkContext`.

The installed package holds the repository's top-level folders:

- ``e31.specs`` -- the declaration: pydantic models, YAML loading, JSON Schema
  (imports only pydantic and yaml);
- ``e31.tasks`` -- the Prefect tasks and what serves them (storage, the work's
  side of a run, the supervisor);
- ``e31.flows`` -- ``run_job``, compiling a spec into a plan, the ``e31`` CLI;
- ``e31.deployments`` -- ``prefect.yaml`` and serving deployments;
- ``e31.examples`` -- the example jobs' work code.

The names below are imported on first use, so ``import e31.specs`` stays
quick (no Prefect, fsspec or torch import).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("e31")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

#: public name -> the module that defines it
_PUBLIC = {
    "JobSpec": "e31.specs",
    "SpecError": "e31.specs",
    "load_spec": "e31.specs",
    "parse_spec": "e31.specs",
    "E31Error": "e31.errors",
    "run_job": "e31.flows.job",
    "JobFailedError": "e31.flows.job",
    "WorkContext": "e31.tasks.work.context",
}

__all__ = sorted([*_PUBLIC, "__version__"])


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562)."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'e31' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
