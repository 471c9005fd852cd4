"""The ``return`` task: copy the output to ``output.url``, manifest last.

Every file the work wrote under its output folder is uploaded with fsspec,
read back and checked (bytes and sha256), then ``manifest.json`` is written;
its presence at the destination means the upload is whole.  A completed
manifest of the same run is never rewritten.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from concurrent.futures import ThreadPoolExecutor

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.tasks import exponential_backoff
from prefect.artifacts import create_link_artifact, create_table_artifact

from e31.errors import E31Error
from e31.specs import mask_url
from e31.tasks import settings, storage
from e31.tasks.manifest import build_manifest, step_text, verdict
from e31.tasks.outcome import RunOutcome
from e31.tasks.retrying import retry_unless
from e31.tasks.storage.progress import TransferProgress

MANIFEST = "manifest.json"
UPLOAD_THREADS = 8  # files uploaded at once by the return step
RETURN_RETRIES = settings.value("E31_TRANSFER_RETRIES")  # Prefect retries of the return task
RETURN_BACKOFF_S = settings.value("E31_TRANSFER_BACKOFF_S")  # first retry delay (s), doubling


class DestinationError(E31Error, RuntimeError):
    """A destination URL cannot be written (unknown protocol, missing fsspec
    backend, a file where a folder should be, no permission)."""


def check_destination(url: str, field: str) -> None:
    """Fail fast, before anything is staged or run, when ``url`` cannot take
    output: its filesystem must load, and a local destination must be a
    folder this process can create and write.  Raises
    :class:`DestinationError` naming ``field`` and the masked URL."""
    shown = mask_url(url)
    try:
        fs, path = storage.filesystem(url)
    except (ValueError, ImportError) as exc:
        raise DestinationError(f"{field}: {shown}: {exc}") from None
    if not storage.is_local(url):
        # object stores: write and delete a small probe object (reachable, credentials, permission)
        probe = storage.join(url, f".e31-probe-{uuid.uuid4().hex[:8]}")
        try:
            storage.write_bytes(probe, b"e31 write probe\n")
            storage.remove(probe)
        except Exception as exc:
            raise DestinationError(f"{field}: {shown}: cannot write there ({storage.describe_error(exc)})") from None
        return
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DestinationError(f"{field}: {shown}: a file is in the way; the destination must be a folder") from None
    except OSError as exc:
        raise DestinationError(f"{field}: {shown}: cannot create it ({exc.strerror})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DestinationError(f"{field}: {shown}: not writable by this user")


def write_failure_manifest(req: ReturnTarget, message: str) -> dict[str, Any] | None:
    """Write a ``failed`` manifest (no files) for a run that never started,
    unless this run already completed there; returns it (None when the
    destination cannot be written either)."""
    manifest = build_manifest(
        job=req.job, run_id=req.run_id, verdict=verdict("error", None, req.declared, set(), message), exit_code=None,
        step=None, files=[], checkpoint=None, timings={"staging_s": req.staging_s, "run_s": 0.0, "return_s": 0.0},
        gpus=req.gpus, cpus=req.cpus, spec_sha256=req.spec_sha256,
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    try:
        storage.write_bytes(storage.join(req.output_url, MANIFEST), json.dumps(manifest, indent=2).encode())
    except Exception:
        return None
    return manifest


@dataclass
class ReturnTarget:
    """Where and what the return step delivers.  ``staging_s`` in seconds."""

    job: str
    run_id: str | None
    output_dir: str
    output_url: str
    declared: list[str]
    gpus: int
    cpus: int
    spec_sha256: str
    staging_s: float = 0.0


def existing_manifest(output_url: str) -> dict[str, Any] | None:
    """The manifest now at ``output_url``, or None when absent or unreadable."""
    try:
        return json.loads(storage.read_bytes(storage.join(output_url, MANIFEST)))
    except (FileNotFoundError, ValueError):
        return None


def _output_files(root: Path) -> list[tuple[Path, str]]:
    """``(path, relative POSIX name)`` of every file the work left under
    ``root``, the manifest excepted.  A symlink that leads out of ``root``
    is refused: the return never reaches outside the job's output folder."""
    files = []
    real_root = root.resolve()
    for path in storage.walk_files(root):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST:
            continue
        if path.is_symlink() and not path.resolve().is_relative_to(real_root):
            raise DestinationError(f"output file {rel} is a symlink out of the output folder ({path.resolve()}); "
                                   "write files, not links, into ctx.output_dir")
        files.append((path, rel))
    return files


def _publish_all(pairs: list[tuple[Path, str]], output_url: str) -> list[dict[str, Any]]:
    """Upload files in parallel (:data:`UPLOAD_THREADS`), each whole and
    verified; returns the manifest's ``files`` rows in ``pairs`` order."""
    total = sum(p.stat().st_size for p, _ in pairs)
    with TransferProgress("return", total, len(pairs)) as progress:
        def one(pair: tuple[Path, str]) -> dict[str, Any]:
            path, rel = pair
            url = storage.join(output_url, rel)
            try:
                size, digest = storage.publish_file(path, url, callback=progress.callback())
            except storage.VerifyError as exc:
                raise storage.VerifyError(f"{mask_url(url)}: {exc}") from None
            return {"path": rel, "bytes": size, "sha256": digest}

        if len(pairs) <= 1:
            return [one(p) for p in pairs]
        with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
            return list(pool.map(one, pairs))


def deliver(req: ReturnTarget, out: RunOutcome) -> dict[str, Any]:
    """Upload the output and write the manifest; returns the manifest dict.

    Each file is published whole and verified
    (:func:`e31.tasks.storage.publish_file`), in parallel; ``manifest.json`` is
    written last, so its presence means the upload is whole.  Raises
    :class:`storage.VerifyError` when a file does not verify (the manifest is
    then not written), :class:`DestinationError` for a symlink out of the
    output folder, and what the store raises when it cannot be reached.
    """
    started = time.monotonic()
    previous = existing_manifest(req.output_url)
    if previous and previous.get("run_id") == req.run_id and previous.get("status") == "completed":
        return previous  # never downgrade a completed run
    files = _publish_all(_output_files(Path(req.output_dir)), req.output_url)
    present = {f["path"] for f in files}
    v = verdict(out.reason, out.exit_code, req.declared, present, out.message)
    manifest = build_manifest(
        job=req.job,
        run_id=req.run_id,
        verdict=v,
        exit_code=out.exit_code,
        step=out.checkpoint.step if out.checkpoint else None,
        files=files,
        checkpoint=mask_url(out.checkpoint.url) if out.checkpoint else None,
        timings={"staging_s": req.staging_s, "run_s": out.run_s, "return_s": time.monotonic() - started},
        gpus=req.gpus,
        cpus=req.cpus,
        spec_sha256=req.spec_sha256,
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        stderr_tail=out.stderr_tail,
        stop_requested_at=out.stop_requested_at,
        stdout_tail=out.stdout_tail,
        output_lines_dropped=out.output_lines_dropped,
    )
    storage.write_bytes(storage.join(req.output_url, MANIFEST), json.dumps(manifest, indent=2).encode())
    return manifest


@task(name="return", task_run_name="return", retries=RETURN_RETRIES,
      retry_delay_seconds=exponential_backoff(backoff_factor=RETURN_BACKOFF_S), retry_jitter_factor=0.5,
      retry_condition_fn=retry_unless(DestinationError), cache_policy=NO_CACHE)
def return_task(req: ReturnTarget, outcome: RunOutcome) -> dict[str, Any]:
    """Prefect task wrapper of :func:`deliver`, retried with exponential
    backoff after store errors (``E31_TRANSFER_RETRIES``, default 3; first
    delay ``E31_TRANSFER_BACKOFF_S``, default 2 s, doubling); adds a table
    artifact of the returned files and the job's status."""
    manifest = deliver(req, outcome)
    publish_artifacts(req, manifest)
    return manifest


def publish_artifacts(req: ReturnTarget, manifest: dict[str, Any]) -> bool:
    """Show a delivered manifest in the Prefect UI: a ``manifest`` table
    artifact (each returned file with the job's status, reason, step and
    meter) and an ``output`` link artifact to the destination (masked).
    Returns False -- the output is delivered all the same -- when the
    Prefect API cannot take them (logged as a warning)."""
    try:
        _artifacts(req, manifest)
        return True
    except Exception as exc:
        try:
            get_run_logger().warning("manifest artifacts not created (%s: %s)", type(exc).__name__,
                                     storage.scrub(str(exc))[:300])
        except Exception:
            pass
        return False


def _artifacts(req: ReturnTarget, manifest: dict[str, Any]) -> None:
    meter = manifest["meter"]
    verdict_columns = {"status": manifest["status"], "reason": manifest["reason"], "step": manifest["step"], **meter}
    files = manifest["files"] or [{"path": "(none)", "bytes": 0, "sha256": ""}]
    rows = [{**f, **verdict_columns} for f in files]
    create_table_artifact(
        rows,
        key="manifest",
        description=f"{manifest['job']}: {manifest['status']} ({manifest['reason']}), {step_text(manifest['step'])}, "
        f"{meter['cpu_seconds']:g} cpu-s, {meter['gpu_seconds']:g} gpu-s -> {mask_url(req.output_url)}",
    )
    shown = mask_url(req.output_url)
    create_link_artifact(
        link=shown if "://" in shown else Path(shown).resolve().as_uri(),
        link_text=shown,
        key="output",
        description=f"{manifest['job']}: output ({manifest['status']})",
    )
