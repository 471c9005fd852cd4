"""A return that could not be delivered, kept for ``e31 return JOB``.

When the destination cannot be reached even after the return task's
retries, the output stays in the job's scratch folder and
``<scratch>/return-pending.json`` records what to deliver: the return target,
how the run ended, the output's (unresolved) ``storage_options`` — secret
references only, never their values — the error, the files kept (``kept``:
relative path -> bytes, so a later delivery notices files removed since),
and a preview of the manifest that will be written (``kept_in`` names the
folder holding the output).  :func:`load_pending` rebuilds the objects and
:func:`deliver_pending` delivers them (``e31 return JOB``, or the next run of
the job, first thing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from e31.errors import E31Error
from e31.specs import mask_url
from e31.tasks.checkpoint import DurableCheckpoint, upload
from e31.tasks.deliver import ReturnTarget
from e31.tasks.manifest_model import Manifest
from e31.tasks.outcome import RunOutcome
from e31.tasks.storage import use_options
from e31.tasks.storage.credentials import resolve_options
from e31.tasks.work.local_checkpoints import latest_valid

PENDING = "return-pending.json"


def save_pending(scratch: Path, target: ReturnTarget, outcome: RunOutcome, error: str,
                 output_options: dict[str, Any] | None = None, checkpoints: dict[str, Any] | None = None) -> Path:
    """Write ``<scratch>/return-pending.json`` (atomically); returns its path.
    ``checkpoints``: where the job's checkpoints go (``url``, ``keep``,
    ``work_sha256``, local ``dir``, unresolved ``options``), so a later
    delivery also uploads the newest one kept in scratch."""
    outcome_d = asdict(outcome)
    outcome_d["manifest"] = None
    if error != IN_PROGRESS and outcome_d.get("released_at") is None:  # this process gives up: the meter stops
        outcome_d["released_at"] = time.time()
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
    text = json.dumps(record, indent=1)
    try:
        tmp.write_text(text)
    except OSError:  # a full scratch disk: give up the space kept for this record, then write it
        tmp.unlink(missing_ok=True)
        if not release_reserve(scratch):
            raise
        tmp.write_text(text)
    os.replace(tmp, path)
    return path


#: A file of this many bytes kept in each job's scratch folder, released to
#: write the pending record when the scratch disk is full.
RESERVE_BYTES = 256 * 1024
RESERVE = ".e31-reserve"


def keep_reserve(scratch: Path) -> None:
    """Keep :data:`RESERVE_BYTES` of the scratch disk for the pending record
    (a return must be recordable even when the work filled the disk); a
    no-op when the space is not there."""
    path = Path(scratch) / RESERVE
    if path.is_file() and path.stat().st_size == RESERVE_BYTES:
        return
    try:
        with open(path, "wb") as fh:
            fh.write(b"\0" * RESERVE_BYTES)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError:
        path.unlink(missing_ok=True)


def release_reserve(scratch: Path) -> bool:
    """Remove the reserve (see :func:`keep_reserve`); returns whether there was one."""
    path = Path(scratch) / RESERVE
    if not path.exists():
        return False
    path.unlink()
    return True


@dataclasses.dataclass(frozen=True)
class PendingReturn:
    """A pending return read back from ``return-pending.json``: where the
    output goes (``target``), how the run ended (``outcome``), the output's
    unresolved ``output_options`` and where the job's ``checkpoints`` go
    (``url``, ``keep``, ``work_sha256``, local ``dir``, unresolved
    ``options``; None when not recorded)."""

    target: ReturnTarget
    outcome: RunOutcome
    output_options: dict[str, Any]
    checkpoints: dict[str, Any] | None


def load_pending(scratch: Path) -> PendingReturn | None:
    """The pending return in ``scratch``, or None when there is none.
    Raises ``ValueError``/``KeyError``/``TypeError`` for an unreadable record."""
    path = Path(scratch) / PENDING
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    out = dict(record["outcome"])
    out["checkpoint"] = DurableCheckpoint(**out["checkpoint"]) if out.get("checkpoint") else None
    out["uploads"] = [DurableCheckpoint(**u) for u in out.get("uploads") or []]
    return PendingReturn(ReturnTarget(**record["target"]), RunOutcome(**out), record.get("output_options") or {},
                         record.get("checkpoints"))


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


#: The pending record's ``error`` while a return is under way: what ``e31 return`` says if it was cut.
IN_PROGRESS = "a return was in progress and did not finish (the process was killed, or is still running)"


def cut_return_of(scratch: Path, flow_run_id: str) -> bool:
    """Whether ``scratch`` (one job's folder) holds a pending return of the
    flow run ``flow_run_id`` that was cut while under way (its ``error`` is
    :data:`IN_PROGRESS`: its flow process died during the return)."""
    try:
        record = json.loads((Path(scratch) / PENDING).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("error") == IN_PROGRESS and \
        (record.get("target") or {}).get("run_id") == flow_run_id


#: What a signal that comes during a return prints (it is not obeyed).
RETURNING_FIRST = "e31: returning the output first (kill -9 abandons it)"


@contextlib.contextmanager
def recorded_return(scratch: Path, target: ReturnTarget, outcome: RunOutcome,
                    output_options: dict[str, Any] | None = None,
                    checkpoints: dict[str, Any] | None = None) -> Iterator[None]:
    """Around a return: the pending record is written before the first
    byte goes to the destination and removed once the block ends without
    an error, so a return cut in any way (kill -9, a lost machine, the
    store gone) can be finished by ``e31 return JOB`` or the next run.
    On an error the record stays, naming it.  A SIGTERM or SIGINT within
    the block (a Prefect worker sends one after each cancel, whenever its
    observer sees it) is noted on stderr and does not cut the return: it
    is bounded, and only kill -9 abandons it."""
    from e31.tasks.supervisor.process import signals_deferred

    save_pending(scratch, target, outcome, IN_PROGRESS, output_options, checkpoints)
    try:
        with signals_deferred(RETURNING_FIRST):
            yield
    except BaseException as exc:
        from e31.tasks.storage import scrub

        if isinstance(exc, Exception) and permanent(exc):  # no later try can do better: say so, drop the record
            give_up(scratch, target, exc)
            raise
        save_pending(scratch, target, outcome, f"{type(exc).__name__}: {scrub(str(exc))}", output_options, checkpoints)
        raise
    clear_pending(scratch)


def permanent(exc: BaseException) -> bool:
    """Whether a return failed for a reason no later try can change (a name
    the destination cannot hold, a file where a folder must go, text that
    cannot be encoded), as opposed to a store that cannot be reached now."""
    import errno

    if isinstance(exc, (UnicodeError, FileExistsError, NotADirectoryError, IsADirectoryError)):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ENAMETOOLONG, errno.EEXIST, errno.ENOTDIR, errno.EISDIR)


def give_up(scratch: Path, target: ReturnTarget, exc: BaseException) -> None:
    """A return that can never succeed as it is: write a ``failed`` manifest
    (no files) into the destination's ``partial/`` saying why and where the
    output is kept, and drop the pending record so later runs are not
    blocked by it."""
    from e31.tasks.deliver import write_failure_manifest
    from e31.tasks.storage import scrub

    write_failure_manifest(target, f"the output cannot be returned as it is ({type(exc).__name__}: "
                                   f"{scrub(str(exc))}); it is kept in {target.output_dir}; change the work so its "
                                   "files can be written there, and run the job again")
    clear_pending(scratch)


class KeptOutputGoneError(E31Error, RuntimeError):
    """The output a pending return kept in scratch is no longer there."""


def deliver_pending(scratch: Path, drop_if_gone: bool = False) -> dict[str, Any] | None:
    """Deliver the return an earlier attempt of a job could not (see
    this module) from its scratch folder; returns the manifest, or
    None when none was pending.  The pending record and, for a completed
    job, the scratch output are removed only after the destination verified
    every file.  Raises what the delivery raises (the output stays), and
    :class:`KeptOutputGoneError` -- with nothing sent to the destination and the
    record kept -- when the kept output folder, or a declared file of a
    completed run, has been removed since; with ``drop_if_gone`` (a new run
    of the job, which will write the output anew) the record is dropped
    with a warning and None returned instead."""
    pending = load_pending(scratch)
    if pending is None:
        return None
    target, outcome, options = pending.target, pending.outcome, pending.output_options
    missing = kept_missing(scratch)
    if missing:
        problem = (f"the output kept in {target.output_dir} for {mask_url(target.output_url)} is gone "
                   f"({missing}); nothing was delivered")
        if not drop_if_gone:
            raise KeptOutputGoneError(f"{problem}; run the job again to produce it anew (that drops "
                                 f"{scratch / 'return-pending.json'})")
        warn(f"{problem}; running the job again")
        clear_pending(scratch)
        return None
    if options:
        use_options(target.output_url, resolve_options(options, "output.storage_options"))
    outcome = _upload_kept_checkpoint(pending.checkpoints, outcome)
    from e31.tasks.returning import return_output  # (it records returns with this module)

    manifest = return_output(scratch, target, outcome, output_options=options, checkpoints=pending.checkpoints,
                             artifacts=False)
    _bill(target, manifest)
    if Manifest.model_validate(manifest).status == "completed":
        shutil.rmtree(scratch / "output", ignore_errors=True)
        shutil.rmtree(scratch / "checkpoints", ignore_errors=True)
    return manifest


def _bill(target: Any, manifest: dict[str, Any]) -> None:
    """The delivered manifest's artifacts on the flow run whose work it was (its ``run_id``), so that the
    Prefect UI shows it and ``e31 usage`` bills its meter; nothing without a Prefect server
    (``PREFECT_API_URL``) or a run id.  A failure is a warning: the output is delivered all the same."""
    from prefect.settings import PREFECT_API_URL

    run_id = manifest.get("run_id")
    if run_id and PREFECT_API_URL.value():
        from e31.tasks.deliver import publish_artifacts

        publish_artifacts(target, manifest, backoff_s=(1.0, 2.0), flow_run_id=run_id)


def _upload_kept_checkpoint(kept: dict[str, Any] | None, outcome: RunOutcome) -> RunOutcome:
    """Upload the newest checkpoint kept in scratch (``kept``: the record's
    ``checkpoints``) when it is newer than the one the run made durable (the
    destination was down for its uploads too); returns the outcome naming
    it.  Raises what the upload raises."""
    if not kept:
        return outcome
    newest = latest_valid(Path(kept["dir"]))
    if newest is None or (outcome.checkpoint is not None and outcome.checkpoint.step >= newest.step):
        return outcome
    if kept.get("options"):
        use_options(kept["url"], resolve_options(kept["options"], "output.checkpoint.storage_options"))
    durable = upload(newest.path, kept["url"], int(kept["keep"]), kept.get("work_sha256"), kept.get("run_id"))
    return dataclasses.replace(outcome, checkpoint=durable)


def warn(line: str) -> None:
    """Log ``line`` as a warning to the run's logger, or to stderr outside a run."""
    try:
        from prefect import get_run_logger

        get_run_logger().warning("%s", line)
    except Exception:
        print(f"e31: {line}", file=sys.stderr)
