"""``e31 compile``'s listing of a job's inputs: every input listed (files,
bytes) and the staging time estimated at ``E31_STAGE_RATE_MIBS``."""

from __future__ import annotations

import contextlib
import sys

from e31.errors import EXIT_FAILED, EXIT_OK, E31Error
from e31.flows.compile import JobPlan
from e31.specs import JobSpec
from e31.tasks import settings


def list_inputs(spec: JobSpec, plan: JobPlan) -> int:
    """Print each input's kind, file count and size, and the total with a
    staging estimate; returns the exit code (1 when an input cannot be
    listed or its credentials resolved, named on stderr).  A Prefect API is
    started only when a ``{secret: BLOCK}`` reference needs one."""
    from e31.tasks.stage import preflight
    from e31.tasks.storage.credentials import uses_secret_blocks
    from e31.tasks.storage.options import register_storage
    from e31.tasks.storage.progress import human_bytes

    if not spec.data:
        return EXIT_OK
    rate = settings.value("E31_STAGE_RATE_MIBS")
    try:
        needs_api = any(uses_secret_blocks(options) for options in (
            *(d.storage_options for d in spec.data), spec.output.storage_options,
            spec.output.checkpoint.storage_options if spec.output.checkpoint else None))
        if needs_api:
            from e31.prefect_compat.tempserver import prefect_api

            api = prefect_api()
        else:
            api = contextlib.nullcontext()
        with api:
            register_storage(spec, plan)
        listings = preflight(plan.inputs)
    except E31Error as exc:
        print(f"e31: {exc}", file=sys.stderr)
        return EXIT_FAILED
    total = sum(x.bytes for x in listings.values())
    files = sum(len(x.entries) for x in listings.values())
    seconds = total / (rate * 2**20)
    print(f"  data: {len(listings)} input(s), {files} file(s), {human_bytes(total)} ({total} bytes); "
          f"~{duration_text(seconds)} to stage at {rate:g} MiB/s")
    for name, x in listings.items():
        kind = "glob (a pattern: no object has that exact name)" if x.kind == "glob" else x.kind
        unknown = " (size not said by the store: known once staged)" if x.size_unknown else ""
        print(f"    {name}: {kind}, {len(x.entries)} file(s), {human_bytes(x.bytes)}{unknown}")
    return EXIT_OK


def duration_text(seconds: float) -> str:
    """``seconds`` as ``12 s``, ``35 min``, ``7.5 h`` or ``3.2 d``."""
    for unit, size, limit in (("s", 1, 120), ("min", 60, 120 * 60), ("h", 3600, 72 * 3600)):
        if seconds < limit:
            return f"{seconds / size:.0f} {unit}" if unit != "h" else f"{seconds / size:.1f} h"
    return f"{seconds / 86400:.1f} d"
