"""One delivery of an output to ``output.url``, manifest last (the ``return``
task and every other return call it through :mod:`e31.tasks.returning`).

A completed run's files go to the top of ``output.url``; a run that did not
complete (partial, failed) returns into ``<output.url>/partial/`` and never
touches an earlier complete output.  Either way the folder's manifest is
first withdrawn (``status: returning``), each file is published whole and
verified (bytes, ETag or read-back sha256), files an earlier run left are
removed, and ``manifest.json`` is written last (:mod:`e31.tasks.destination`):
at every instant a manifest at the destination describes exactly the files
beside it, or says a return is in progress.  A completed manifest of the same
run is never rewritten.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from concurrent.futures import ThreadPoolExecutor

from prefect.logging import get_run_logger
from prefect.artifacts import create_link_artifact, create_table_artifact

from e31.errors import E31Error
from e31.specs import mask_url
from e31.tasks import settings, storage
from e31.tasks.destination import MANIFEST, PARTIAL, Destination, read_manifest
from e31.tasks.manifest import Verdict, build_manifest, step_text, verdict
from e31.tasks.manifest_model import Manifest, parse_manifest
from e31.tasks.outcome import RunOutcome
from e31.tasks.storage.local import regular_files
from e31.tasks.storage.progress import TransferProgress
from e31.prefect_compat.api import api_answers

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
        raise DestinationError(f"{field}: {shown}: a file is in the way; the destination must be a folder: give "
                               "a folder of the job's own") from None
    except OSError as exc:
        raise DestinationError(f"{field}: {shown}: cannot create it ({exc.strerror}): give a folder this user "
                               "can create, of the job's own, e.g. ~/results/NAME/") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DestinationError(f"{field}: {shown}: not writable by this user: give a folder it can write, or "
                               "make this one writable")


@dataclass
class ReturnTarget:
    """Where and what the return step delivers: the ``job`` and flow run
    (``run_id``), the local ``output_dir``, the ``output_url``, the
    ``declared`` output files, the request's ``gpus``/``cpus`` (for the
    meter, :mod:`e31.tasks.meter`), the spec's sha256, ``staging_s`` (seconds staging in the run,
    resources held), ``prefetch_s`` (seconds the node's prefetcher staged
    the inputs before the allocation; 0: none), ``staged_before_allocation``
    (see :func:`e31.tasks.manifest.build_manifest`), the durable
    ``checkpoint_url`` (a sub-folder of the output URL by default) and
    ``handover_wait_s`` (seconds a run handed over behind another waited,
    after its staging, for that run to end; 0: none) with
    ``handover_staging_s`` (its staging, made meanwhile: not metered), and
    ``attempt``: a token of the flow process that ran this attempt of the
    run (a run queued again after its node was lost runs again under the
    same flow run id, elsewhere: its return replaces the earlier
    attempt's even when that one was complete; None: not known).
    ``preemptions`` and ``lost_s``: the queue's earlier preemptions of the
    run and the seconds of work they threw away (its placement record).
    ``tenant``: the pool's tenant the run is for (its tag; None outside a queue)."""

    job: str
    run_id: str | None
    output_dir: str
    output_url: str
    declared: list[str]
    gpus: int
    cpus: int
    spec_sha256: str
    staging_s: float = 0.0
    checkpoint_url: str = ""
    prefetch_s: float = 0.0
    staged_before_allocation: bool | None = None
    handover_wait_s: float = 0.0
    handover_staging_s: float = 0.0
    attempt: str | None = None
    preemptions: int = 0
    lost_s: float = 0.0
    tenant: str | None = None


def preempted_so_far(req: ReturnTarget, out: RunOutcome, reason: str) -> dict[str, Any]:
    """The manifest's ``preemptions`` and ``lost_s``: the run's earlier preemptions (``req``), and this
    stop when its ``reason`` is ``preempted``, which throws away the work since this attempt's newest
    durable checkpoint (or since its work's start; none when the work never started)."""
    count, lost = req.preemptions, req.lost_s
    if reason == "preempted":
        count += 1
        since = max(filter(None, (out.checkpoint_at, out.work_started_at)), default=None)
        if since is not None and out.stop_requested_at is not None:
            lost += max(0.0, out.stop_requested_at - since)
    return {"preemptions": count, "lost_s": lost}


def existing_manifest(output_url: str) -> dict[str, Any] | None:
    """The manifest now at the top of ``output_url`` (the newest completed
    run's, or a ``returning`` one), or None when absent or unreadable."""
    return read_manifest(output_url)


def _publish_all(pairs: list[tuple[Path, str]], root_url: str) -> list[dict[str, Any]]:
    """Upload files in parallel (:data:`UPLOAD_THREADS`), each whole and
    verified; returns the manifest's ``files`` rows in ``pairs`` order."""
    total = sum(p.stat().st_size for p, _ in pairs)
    with TransferProgress("return", total, len(pairs)) as progress:
        def one(pair: tuple[Path, str]) -> dict[str, Any]:
            path, rel = pair
            url = storage.join(root_url, rel)
            try:
                size, digest = storage.publish_file(path, url, callback=progress.callback())
            except storage.VerifyError as exc:
                raise storage.VerifyError(f"{mask_url(url)}: {exc}") from None
            return {"path": rel, "bytes": size, "sha256": digest}

        if len(pairs) <= 1:
            return [one(p) for p in pairs]
        with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
            return list(pool.map(one, pairs))


def _skip(req: ReturnTarget) -> tuple[str, ...]:
    """Top-level sub-folders of the output URL that are not output files:
    ``partial/`` and the durable checkpoint folder when it lies inside."""
    skip = [PARTIAL]
    top = req.output_url.rstrip("/") + "/"
    if req.checkpoint_url.startswith(top):
        skip.append(req.checkpoint_url[len(top):].strip("/").split("/", 1)[0])
    return tuple(skip)


def deliver(req: ReturnTarget, out: RunOutcome) -> dict[str, Any]:
    """Return the output and write the manifest; returns the manifest dict.

    The verdict is decided first (:func:`e31.tasks.manifest.verdict`): output
    files that may not leave the job (a link out of the output folder, a
    hard link, a FIFO or device: :func:`e31.tasks.storage.local.regular_files`)
    fail it, named, and are not sent.  A completed run returns to the top
    of ``output.url``, any other to ``partial/``, through the protocol of
    :class:`e31.tasks.destination.Destination`; a completed run then removes
    a superseded ``partial/``.  Raises :class:`storage.VerifyError` when a
    file does not verify and what the store raises when it cannot be
    reached (the manifest stays ``returning``; a later return finishes it).
    """
    started = time.monotonic()
    top = read_manifest(req.output_url)
    kept = parse_manifest(top)
    if isinstance(kept, Manifest) and kept.run_id == req.run_id and kept.status == "completed" and \
            kept.attempt == req.attempt:
        return top  # never downgrade a completed run (the same attempt returning again: a late signal, a retry)
    files, refused = regular_files(Path(req.output_dir))
    reserved = (*_skip(req), MANIFEST)
    for _, rel in files:
        if rel.split("/", 1)[0] in reserved:
            refused.append(f"{rel}: manifest.json at the destination is E31's; write the work's file under another "
                           "name" if rel == MANIFEST else
                           f"{rel}: {rel.split('/', 1)[0]}/ at the destination is E31's (partial runs, durable "
                           "checkpoints); write the file under another folder name")
    files = [(path, rel) for path, rel in files if rel.split("/", 1)[0] not in reserved]
    v = verdict(out.reason, out.exit_code, req.declared, {rel for _, rel in files}, out.message)
    if refused:
        v = Verdict("failed", "error", "; ".join(filter(None, [
            "output files refused, not returned: " + "; ".join(refused), v.message if v.status == "failed" else ""])))
    completed = v.status == "completed"
    folder = req.output_url if completed else storage.join(req.output_url, PARTIAL)
    dest = Destination(folder, skip=_skip(req) if completed else ())
    dest.withdraw(req.job, req.run_id, [rel for _, rel in files])
    dest.remove_temporaries([rel for _, rel in files], own_folder=not completed)
    if not completed:  # a complete return killed in its manifest writes left a temporary at the top: not kept
        Destination(req.output_url, skip=_skip(req)).remove_strays()  # there until the next complete run
    rows = _publish_all(files, folder)
    stale = dest.settle({row["path"] for row in rows}, own_folder=not completed)
    released_at = out.released_at or time.time()  # the output is returned: the meter stops (tasks/meter.py)
    manifest = build_manifest(
        job=req.job,
        run_id=req.run_id,
        verdict=v,
        exit_code=out.exit_code,
        step=out.checkpoint.step if out.checkpoint else None,
        files=rows,
        checkpoint=mask_url(out.checkpoint.url) if out.checkpoint else None,
        timings={"prefetch_s": req.prefetch_s, "staging_s": req.staging_s, "run_s": out.run_s, **out.phases,
                 **({"handover_staging_s": req.handover_staging_s, "handover_wait_s": req.handover_wait_s}
                    if req.handover_wait_s else {}),
                 "return_s": time.monotonic() - started},
        gpus=req.gpus,
        cpus=req.cpus,
        spec_sha256=req.spec_sha256,
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        stderr_tail=out.stderr_tail,
        stop_requested_at=out.stop_requested_at,
        stdout_tail=out.stdout_tail,
        output_lines_dropped=out.output_lines_dropped,
        folder="." if completed else PARTIAL,
        stale=stale,
        peak_memory=out.peak_memory,
        staged_before_allocation=req.staged_before_allocation,
        attempt=req.attempt,
        work_started_at=out.work_started_at,
        released_at=released_at,
        resumed_from_step=out.resumed_from_step,
        tenant=req.tenant,
        **preempted_so_far(req, out, v.reason),
    )
    if completed:
        Destination(storage.join(req.output_url, PARTIAL)).clear()  # superseded by this complete output
    dest.publish_manifest(manifest)
    return manifest


def write_failure_manifest(req: ReturnTarget, message: str) -> dict[str, Any] | None:
    """Return a ``failed`` verdict with no files for a run that never
    started (an input that cannot be staged or read), into
    ``<output.url>/partial/``: an earlier complete output stays as it was,
    and the run's failure is said there.  Returns the manifest, or None when
    the destination cannot be written either."""
    empty = Path(req.output_dir) / ".e31-nothing"
    try:
        return deliver(dataclasses.replace(req, output_dir=str(empty)),
                       RunOutcome(reason="error", exit_code=None, run_s=0.0, message=message))
    except Exception:
        return None


#: Seconds between tries of the manifest artifacts while the Prefect API does not answer (a busy or
#: restarting server): 5 tries over ~15 s (plus up to 2 s per health check), then the run goes on without them.
ARTIFACT_BACKOFF_S = (1.0, 2.0, 4.0, 8.0)


def publish_artifacts(req: ReturnTarget, manifest: dict[str, Any],
                      backoff_s: tuple[float, ...] = ARTIFACT_BACKOFF_S, flow_run_id: str | None = None) -> bool:
    """Show a delivered manifest in the Prefect UI: a ``manifest`` table
    artifact (each returned file with the job's status, reason, step,
    meter, preemptions and lost work) and an ``output`` link artifact to the destination (masked),
    on the current flow run, or on the flow run ``flow_run_id`` (a return an earlier run kept, delivered
    by ``e31 return`` or by a later run: its meter is billed to the run whose work it was).
    While the Prefect API does not answer or refuses, tries again after each
    of ``backoff_s`` seconds (an artifact already made is not made twice);
    returns False -- the output is delivered all the same -- when the last
    try failed too (each failure logged as a warning, masked)."""
    made: set[str] = set()
    for attempt in range(len(backoff_s) + 1):
        try:
            if not api_answers():  # Prefect's client would retry for minutes: the output is delivered all the same
                raise ConnectionError("the Prefect API does not answer")
            _artifacts(req, manifest, made, flow_run_id)
            return True
        except Exception as exc:
            why = f"{type(exc).__name__}: {storage.scrub(str(exc))[:300]}"
        if attempt == len(backoff_s):
            _warn(f"manifest artifacts not created ({why}) after {attempt + 1} tries; the output is delivered, "
                  f"its manifest.json says the same")
            return False
        _warn(f"manifest artifacts not created yet ({why}); trying again in {backoff_s[attempt]:g} s "
              f"(try {attempt + 2} of {len(backoff_s) + 1})")
        time.sleep(backoff_s[attempt])
    return False


def _warn(line: str) -> None:
    try:
        get_run_logger().warning("%s", line)
    except Exception:
        pass


def _artifacts(req: ReturnTarget, manifest: dict[str, Any] | Manifest, made: set[str],
               flow_run_id: str | None = None) -> None:
    """Create the ``manifest`` and ``output`` artifacts not in ``made`` yet (on the flow run
    ``flow_run_id``: through the client, outside that run), adding each key to ``made`` once created.
    Raises ``pydantic.ValidationError`` when ``manifest`` is not a final manifest."""
    m = Manifest.model_validate(manifest)
    meter = m.meter
    verdict_columns = {"status": m.status, "reason": m.reason, "step": m.step, **meter.model_dump(),
                       "preemptions": m.preemptions, "lost_s": m.lost_s}
    files = [f.model_dump() for f in m.files] or [{"path": "(none)", "bytes": 0, "sha256": ""}]
    rows = [{**f, **verdict_columns} for f in files]
    described = (f"{m.job}: {m.status} ({m.reason}), {step_text(m.step)}, {meter.cpu_seconds:g} cpu-s, "
                 f"{meter.gpu_seconds:g} gpu-s -> {mask_url(req.output_url)}")
    shown = mask_url(req.output_url)
    link = shown if "://" in shown else Path(shown).resolve().as_uri()
    if flow_run_id is not None:
        _artifacts_of(flow_run_id, rows, described, link, shown, f"{m.job}: output ({m.status})", made)
        return
    if "manifest" not in made:
        create_table_artifact(rows, key="manifest", description=described)
        made.add("manifest")
    if "output" not in made:
        create_link_artifact(link=link, link_text=shown, key="output", description=f"{m.job}: output ({m.status})")
        made.add("output")


def _artifacts_of(flow_run_id: str, rows: list[dict[str, Any]], described: str, link: str, shown: str,
                  link_described: str, made: set[str]) -> None:
    """:func:`_artifacts`'s two artifacts made on the flow run ``flow_run_id`` from outside it (Prefect's
    ``create_*_artifact`` attach to the current run only, and warn outside one)."""
    import json
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate

    with get_client(sync_client=True) as client:
        if "manifest" not in made:
            client.create_artifact(ArtifactCreate(key="manifest", type="table", description=described,
                                                  data=json.dumps(rows), flow_run_id=UUID(flow_run_id)))
            made.add("manifest")
        if "output" not in made:
            client.create_artifact(ArtifactCreate(key="output", type="markdown", description=link_described,
                                                  data=f"[{shown}]({link})", flow_run_id=UUID(flow_run_id)))
            made.add("output")
