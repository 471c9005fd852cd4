"""What the run task says of its work's run, apart from its outcome: the output folder it starts with,
the ``resumed from step N`` line, and where the run's time went (the child's marks)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

from prefect.logging import get_run_logger

from e31.specs import mask_url
from e31.tasks import storage
from e31.tasks.work.local_checkpoints import parse_step


def empty_output(folder: Path) -> None:
    """Empty the work's output folder (created when missing) before its
    work starts: a run's output holds what its own work writes, and only
    the checkpoint (``E31_RESUME_DIR``, ``ctx.restore()``) carries over from
    a stopped or lost attempt, as it does when the run resumes on another
    machine (docs/stops-and-resumes.md, "What a resumed run keeps").  The stopped attempt's
    files were returned already (a pending return is delivered before any
    run starts).  Raises ``OSError`` when the folder cannot be emptied."""
    folder.mkdir(parents=True, exist_ok=True)
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


#: Called with the line ``resumed from step N (URL)`` when a run's work resumes from a checkpoint
#: (``e31 run`` prints it on its stdout); a hook that raises is skipped.
ON_RESUME: list[Callable[[str], None]] = []

#: A log record's attribute: its text was printed on the console by an :data:`ON_RESUME` hook already.
PRINTED = "e31_printed"


def say_resume(resume_dir: str, checkpoint_url: str) -> int | None:
    """The step of the checkpoint folder ``resume_dir`` the work is given
    (``E31_RESUME_DIR``; empty: a fresh start, None), said in the run's log
    and to each of :data:`ON_RESUME` as ``resumed from step N (URL)`` with
    the durable checkpoint's URL (masked)."""
    if not resume_dir:
        return None
    name = Path(resume_dir).name
    step = parse_step(name)
    if step is None:
        return None
    line = f"resumed from step {step} ({mask_url(storage.join(checkpoint_url, name))})"
    get_run_logger().info("%s", line, extra={PRINTED: bool(ON_RESUME)})
    for hook in list(ON_RESUME):
        try:
            hook(line)
        except Exception:
            pass
    return step


def read_time(marker: Path) -> float | None:
    """The Unix time written in ``marker`` by the child, or None (never written)."""
    try:
        return float(marker.read_text())
    except (OSError, ValueError):
        return None


def time_phases(spawned: float, begun: Path, returned: Path, exited: float) -> dict[str, float]:
    """Where the run's time went, in seconds: ``child_start_s`` (spawn to the
    work's first line: the interpreter, E31, the entrypoint's imports),
    ``work_s`` (the work's function, to its return or the child's exit) and
    ``settle_s`` (the child's exit to the last checkpoint made durable).
    Only ``settle_s`` for a command (no Python entrypoint to mark)."""
    phases = {"settle_s": time.time() - exited}
    try:
        first = float(begun.read_text())
    except (OSError, ValueError):
        return phases
    try:
        last = returned.stat().st_mtime
    except OSError:
        last = exited
    return {"child_start_s": max(0.0, first - spawned), "work_s": max(0.0, min(last, exited) - first), **phases}
