"""A return that could not be delivered, kept for ``e31 return JOB``.

When the destination cannot be reached even after the return task's
retries, the output stays in the job's scratch folder and
``<scratch>/return-pending.json`` records what to deliver: the return target,
how the run ended, the output's (unresolved) ``storage_options`` — secret
references only, never their values — the error, the files kept (``kept``:
relative path -> bytes, so a later delivery notices files removed since),
and a preview of the manifest that will be written (``kept_in`` names the
folder holding the output).  :func:`load_pending` rebuilds the objects for a later
:func:`tasks.deliver.deliver`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specs import mask_url
from tasks.checkpoint import DurableCheckpoint
from tasks.deliver import ReturnTarget
from tasks.outcome import RunOutcome

PENDING = "return-pending.json"


def save_pending(scratch: Path, target: ReturnTarget, outcome: RunOutcome, error: str,
                 output_options: dict[str, Any] | None = None, checkpoints: dict[str, Any] | None = None) -> Path:
    """Write ``<scratch>/return-pending.json`` (atomically); returns its path.
    ``checkpoints``: where the job's checkpoints go (``url``, ``keep``,
    ``work_sha256``, local ``dir``, unresolved ``options``), so a later
    delivery also uploads the newest one kept in scratch."""
    outcome_d = asdict(outcome)
    outcome_d["manifest"] = None
    record = {
        "target": asdict(target),
        "outcome": outcome_d,
        "output_options": output_options or {},
        "checkpoints": checkpoints,
        "error": error,
        "failed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "manifest": {"job": target.job, "reason": outcome.reason, "step": outcome.checkpoint.step if outcome.checkpoint else None,
                     "delivered": False, "kept_in": target.output_dir, "destination": mask_url(target.output_url),
                     "checkpoint": mask_url(outcome.checkpoint.url) if outcome.checkpoint else None},
    }
    folder = Path(target.output_dir)
    record["kept"] = {p.relative_to(folder).as_posix(): p.stat().st_size
                      for p in sorted(folder.rglob("*")) if p.is_file()} if folder.is_dir() else {}
    path = Path(scratch) / PENDING
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)
    return path


def load_pending(scratch: Path) -> tuple[ReturnTarget, RunOutcome, dict[str, Any]] | None:
    """``(target, outcome, output_options)`` of the pending return in
    ``scratch``, or None when there is none.  Raises ``ValueError`` for an
    unreadable record."""
    path = Path(scratch) / PENDING
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    out = dict(record["outcome"])
    out["checkpoint"] = DurableCheckpoint(**out["checkpoint"]) if out.get("checkpoint") else None
    out["uploads"] = [DurableCheckpoint(**u) for u in out.get("uploads") or []]
    return ReturnTarget(**record["target"]), RunOutcome(**out), record.get("output_options") or {}


def pending_checkpoints(scratch: Path) -> dict[str, Any] | None:
    """The ``checkpoints`` entry of the pending record in ``scratch`` (see
    :func:`save_pending`), or None."""
    try:
        return json.loads((Path(scratch) / PENDING).read_text()).get("checkpoints")
    except (OSError, ValueError, AttributeError):
        return None


def kept_missing(scratch: Path) -> str:
    """What of the output a pending return kept is no longer in scratch
    ('' when all of it is there, or nothing is pending): the folder, or
    files recorded when it was kept (``kept``: relative path -> bytes)."""
    try:
        record = json.loads((Path(scratch) / PENDING).read_text())
    except (OSError, ValueError):
        return ""
    folder = Path(record["target"]["output_dir"])
    if not folder.is_dir():
        return "the folder was removed"
    lost = [rel for rel, size in (record.get("kept") or {}).items()
            if not (folder / rel).is_file() or (folder / rel).stat().st_size != size]
    return f"missing or changed: {', '.join(lost[:5])}" + (f" and {len(lost) - 5} more" if len(lost) > 5 else "") \
        if lost else ""


def clear_pending(scratch: Path) -> None:
    """Remove the pending record (after a verified delivery)."""
    (Path(scratch) / PENDING).unlink(missing_ok=True)
