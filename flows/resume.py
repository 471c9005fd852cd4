"""Decide, before staging, whether a job resumes or starts fresh, and lay
out its scratch folder.

- A verified local checkpoint of the same work (``work_sha256``) resumes.
- Else, durable checkpoints at the checkpoint URL of a run that did not
  complete (a run that stopped early or died with its machine: the
  destination's completed manifest, if any, names another run) are
  fetched back and resumed from.
- Else the run is fresh: local output and checkpoints are cleared; the
  durable checkpoints of an earlier run (committed ``step-<N>`` folders,
  nothing else) are removed only once the inputs are staged and the work
  is about to start (:func:`remove_stale_checkpoints`).
One run of a job at a time per machine: the scratch folder is locked.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from e31.flows.compile import JobPlan
from e31.flows.joblock import JobBusyError, lock_job, unlock_job  # noqa: F401 (JobBusyError: re-exported)
from e31.tasks import storage
from e31.tasks.checkpoint import fetch_newest, holds_part
from e31.tasks.work.local_checkpoints import MARKER, commit_pending, committed, discard_torn, latest_valid, parse_step
from e31.tasks.deliver import existing_manifest
from e31.tasks.manifest_model import Manifest, parse_manifest
from e31.tasks.pending import keep_reserve
from e31.tasks.storage.scratch_cache import release_data, remove_torn, take_data

WORK_HASH_FILE = "work.sha256"
ATTEMPT_FILE = "attempt.json"


@dataclass(frozen=True)
class Resume:
    """``step`` the run resumes from (None: fresh start); ``crashed``: the
    previous attempt of this job never ended (its process was killed)."""

    step: int | None
    crashed: bool


def prepare_scratch(plan: JobPlan) -> Resume:
    """:func:`open_scratch` then :func:`resume_step`: lock the job's scratch
    folder, record this attempt, and decide where the run starts.  Raises
    :class:`JobBusyError` when the same job is running here already."""
    crashed = open_scratch(plan)
    return Resume(resume_step(plan), crashed)


def open_scratch(plan: JobPlan) -> bool:
    """Lock the job's scratch folder, create its folders, commit what a
    killed attempt's work wrote whole, and record this attempt; returns
    whether the previous attempt was lost (its process killed).  Nothing
    kept in scratch is removed here.  Raises :class:`JobBusyError` when the same
    job is running here already."""
    Path(plan.scratch).mkdir(parents=True, exist_ok=True)
    lock_job(plan.scratch, plan.job)
    take_data(plan.scratch)  # a prefetch of the job's inputs (e31 worker) yields; nobody replaces them until the end
    for folder in (plan.data_dir, plan.output_dir, plan.checkpoint_dir, plan.run_dir):
        folder.mkdir(parents=True, exist_ok=True)
    remove_torn(plan.data_dir)  # a staging or a prefetch killed mid-copy
    keep_reserve(Path(plan.scratch))  # room for a pending return record even if the work fills the disk
    commit_pending(plan.checkpoint_dir)  # written whole by a work whose supervisor died too
    discard_torn(plan.checkpoint_dir)
    attempt = plan.run_dir / ATTEMPT_FILE
    crashed = _read_state(attempt) == "running"
    kill_leftovers(plan)  # whatever an earlier run left running (a killed supervisor, a setsid() grandchild)
    attempt.write_text(json.dumps({"state": "running", "pid": os.getpid(), "started": time.time()}))
    return crashed


def kill_leftovers(plan: JobPlan) -> list[int]:
    """SIGKILL what an earlier attempt left running: every process that
    still carries this job's ``E31_CHECKPOINT_DIR`` in its environment, in
    whatever process group or session (a command's children outlive a kill
    -9 of the supervisor; a grandchild may have called ``setsid()``).
    Returns their pids.  Linux only (reads /proc)."""
    from e31.tasks.supervisor.process import TOKEN_VAR
    from e31.tasks.supervisor.warm import warm_tokens

    mark = f"E31_CHECKPOINT_DIR={plan.checkpoint_dir}".encode()
    spared = {f"{TOKEN_VAR}={token}".encode() for token in warm_tokens()}  # this very run's child, and its own
    killed = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
            if mark not in environ or environ & spared:
                continue
            os.kill(int(entry.name), signal.SIGKILL)
            killed.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
    return killed


def end_attempt(plan: JobPlan) -> None:
    """Record that this attempt ended (whatever its status) and release the
    job's lock.  A full scratch disk does not stop it: the lock is released
    all the same (the next attempt then takes this one for a lost one)."""
    try:
        (plan.run_dir / ATTEMPT_FILE).write_text(json.dumps({"state": "ended", "ended": time.time()}))
    except OSError:
        pass
    release_data(plan.scratch)
    unlock_job(plan.scratch)


def _read_state(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("state")
    except (OSError, ValueError, AttributeError):
        return None


def resume_step(plan: JobPlan) -> int | None:
    """The step the run resumes from (see the module docstring), or None for
    a fresh start -- which clears the scratch output and checkpoints, so a
    pending return must have been delivered first."""
    hash_file = plan.run_dir / WORK_HASH_FILE
    same_work = hash_file.is_file() and hash_file.read_text().strip() == plan.work_sha256
    if not same_work:
        _clear(plan.output_dir, plan.checkpoint_dir)
    hash_file.write_text(plan.work_sha256)
    local = latest_valid(plan.checkpoint_dir)
    newer = [c for c in committed(plan.checkpoint_dir) if local is None or c.step > local.step]
    if local is not None and not newer:
        return local.step
    # No whole local checkpoint, or a newer one that is not whole here (one rank's part of a sharded
    # checkpoint, whose whole step may be at the checkpoint URL): the newest durable one that verifies.
    for ckpt in newer:  # never whole: the work's next checkpoints follow the step it resumes from
        shutil.rmtree(ckpt.path, ignore_errors=True)
    top = existing_manifest(plan.output_url)
    rejected: list[str] = []
    step = fetch_newest(plan.checkpoint_dir, plan.checkpoint_url, plan.work_sha256,
                        local.step if local is not None else None,
                        accept=lambda durable: not _completed_by(top, durable), rejected=rejected)
    for line in rejected:
        _say(line)
    if step is not None:
        return step
    if local is not None:
        return local.step
    _clear(plan.output_dir, plan.checkpoint_dir)
    return None


def _say(line: str) -> None:
    """A line in the flow run's log (this module's logger outside a run)."""
    try:
        from prefect.logging import get_run_logger

        get_run_logger().warning("%s", line)
    except Exception:
        import logging

        logging.getLogger("e31").warning("%s", line)


def _completed_by(top: dict | None, durable) -> bool:
    """True when the run that made ``durable`` completed: the output URL's
    top manifest (the newest completed run's) names its flow run.  For a
    checkpoint that does not record its run (written by an older E31), any
    completed manifest counts; a manifest that is not valid counts as none."""
    manifest = parse_manifest(top)
    if not isinstance(manifest, Manifest) or manifest.status != "completed":
        return False
    return durable.run_id is None or durable.run_id == manifest.run_id


def remove_stale_checkpoints(plan: JobPlan) -> list[int]:
    """Remove the durable checkpoints an earlier run left at the checkpoint
    URL (``step-<N>`` folders holding E31's ``COMMITTED`` marker or a rank's
    part of a sharded checkpoint; nothing else), so a fresh run neither resumes from nor keeps them in place of
    its own.  Called once a fresh run has staged its inputs and is about to
    start the work: a run that fails before that leaves them.  Returns the
    removed steps."""
    removed = []
    for name in storage.list_dirs(plan.checkpoint_url):
        step = parse_step(name)
        url = storage.join(plan.checkpoint_url, name)
        if step is not None and (storage.exists(storage.join(url, MARKER)) or holds_part(url)):
            storage.remove(url)
            removed.append(step)
    return sorted(removed)


def _clear(*folders: Path) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)

