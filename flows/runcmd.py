"""``e31 run``: one job in this process, on the Prefect API in
``PREFECT_API_URL`` or a temporary one; the manifest printed, its status as
the exit code (see :mod:`e31.flows.cli` for the other commands)."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from e31.errors import EXIT_FAILED, EXIT_OK, EXIT_PARTIAL
from e31.specs import JobSpec, mask_url
from e31.tasks.manifest import step_text
from e31.tasks.manifest_model import Manifest


def cmd_run(args: argparse.Namespace, spec: JobSpec, notes: list[str]) -> int:
    from e31.flows.admission import check_fits
    from e31.flows.compile import compile_plan
    from e31.flows.joblock import hold_for_run, unlock_job
    from e31.flows.workconfig import child_config
    from e31.tasks.supervisor.warm import discard, prestart

    plan = compile_plan(spec)
    check_fits(plan)  # refused before a flow run exists
    hold_for_run(plan.scratch, plan.job)  # a second run of a running job is refused here and leaves no flow run
    try:
        # The work's child starts loading (interpreter, torch, the entrypoint) while this process
        # loads Prefect, the API starts or answers, the flow run is created and the inputs stage.
        code_dir = str(Path(args.spec).resolve().parent)
        prestart(child_config(spec, plan, {}, code_dir), str(plan.run_dir))
        from e31.prefect_compat.tempserver import prefect_api

        with prefect_api():
            return _run_with_api(spec, plan, code_dir)
    except KeyboardInterrupt:
        print("e31: interrupted before the run started; nothing ran", file=sys.stderr)
        return 130
    finally:
        discard(str(plan.run_dir))
        unlock_job(plan.scratch)


def _run_with_api(spec: JobSpec, plan, code_dir: str) -> int:
    """``e31 run`` once a Prefect API answers: the flow run, in this process.
    ``plan``: the compiled job (checked to fit and not to be running)."""
    from prefect import tags

    from e31.flows.deploy import job_tags
    from e31.flows import exitsignals
    from e31.flows.attempt import DELIVERED, JobFailedError
    from e31.flows.job import run_job
    from e31.prefect_compat.runlog import hide_tracebacks_on_console
    from e31.prefect_compat.statesync import apply_pending, remember
    from e31.tasks.supervisor.report import ON_RESUME

    hide_tracebacks_on_console()
    if _say_resumed not in ON_RESUME:  # `resumed from step N (URL)` on stdout, whatever the log level
        ON_RESUME.append(_say_resumed)
    apply_pending(Path(plan.scratch).parent)  # states the API missed earlier (it was down)
    DELIVERED.pop(spec.name, None)
    exitsignals.HOLD_SIGNALS_AFTER_RETURN = True  # once returned, a late signal does not change the exit code
    _hold_signals_once_delivered(spec.name)
    threading.Thread(target=_leave_when_the_api_stays_down, args=(spec, plan), daemon=True,
                     name="e31-api-watch").start()
    try:
        with tags(*job_tags(spec)):
            manifest = run_job(spec, code_dir=code_dir)
    except JobFailedError as exc:
        print(f"e31: {exc}", file=sys.stderr)
        m = Manifest.model_validate(exc.manifest)
        kept = f"{len(m.files)} file(s)" + (f" and the checkpoint of {step_text(m.step)}" if m.checkpoint else "")
        where = spec.output.url.rstrip("/") + "/" + m.folder + "/"
        print(f"failed: {kept} returned to {mask_url(where)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("e31: interrupted; see the destination's manifest.json for what came back", file=sys.stderr)
        return 130
    except Exception as exc:  # the Prefect API failed; if the output was returned, that is the job's word
        manifest = DELIVERED.get(spec.name)
        if manifest is None or not api_error(exc):
            raise
        remember(Path(plan.scratch), manifest)
        print(f"e31: the Prefect API failed after the output was returned ({type(exc).__name__}); the flow run's "
              f"state is set to what the manifest says when an API answers again (the next e31 run or e31 return "
              f"here does it)", file=sys.stderr)
        m = Manifest.model_validate(manifest)
        if m.status == "failed":
            print(f"e31: job {spec.name} failed: {m.message}", file=sys.stderr)
    return print_manifest(manifest, spec.name, spec.output.url)


def _say_resumed(line: str) -> None:
    """Print ``resumed from step N (URL)`` (the URL masked) as the run's work starts from a checkpoint."""
    print(line, flush=True)


def _hold_signals_once_delivered(job: str) -> None:
    """SIGTERM and SIGINT as usual (exit 143, KeyboardInterrupt) until the
    job's output is delivered, then noted and ignored.  Installed before the
    flow starts because Prefect's engine puts back, when the flow run ends,
    the SIGTERM handler it found at its start (its own replaces it during
    the run and hands a signal on to it); the flow's own holding of signals
    (``e31.flows.exitsignals.hold_signals``) ends there."""
    import signal

    from e31.flows.exitsignals import ignore_signals_at_exit
    from e31.flows.attempt import DELIVERED

    told: list[int] = []

    def handler(signum, frame) -> None:
        if DELIVERED.get(job) is None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if not told:
            told.append(signum)
            print("e31: the output is returned; the signal is ignored and the run ends with its manifest",
                  file=sys.stderr)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)
        ignore_signals_at_exit(when=lambda: DELIVERED.get(job) is not None)


API_GONE_S = 20.0  # seconds the Prefect API must stay unreachable, once the output is returned, before e31 run leaves


def _leave_when_the_api_stays_down(spec: JobSpec, plan) -> None:
    """Once the job's output is returned (its manifest written), the job is
    done whatever the Prefect API does: if the API then stays unreachable
    for :data:`API_GONE_S` seconds, Prefect's client would retry its state
    updates and events for minutes.  Record the state the flow run must get
    (:mod:`e31.prefect_compat.statesync`), print the manifest and exit with its code."""
    from e31.flows.attempt import DELIVERED
    from e31.prefect_compat.statesync import remember
    from e31.prefect_compat.api import api_ready

    url = os.environ.get("PREFECT_API_URL", "")
    down_since = None
    while True:
        time.sleep(1.0)
        manifest = DELIVERED.get(spec.name)
        if manifest is None or not url:
            continue
        if api_ready(url):
            down_since = None
            continue
        down_since = down_since or time.monotonic()
        if time.monotonic() - down_since < API_GONE_S:
            continue
        remember(Path(plan.scratch), manifest)
        print(f"e31: the Prefect API at {url} stopped answering after the output was returned; the flow run's state "
              "is set to what the manifest says when an API answers again (the next e31 run or e31 return here "
              "does it)", file=sys.stderr)
        code = print_manifest(manifest, spec.name, spec.output.url)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def print_manifest(manifest: dict[str, Any] | Manifest, job: str, url: str) -> int:
    """Print a final manifest for a person (verdict, destination, each file,
    the checkpoint); returns the exit code its status maps to (completed 0,
    partial :data:`e31.errors.EXIT_PARTIAL`, failed :data:`e31.errors.EXIT_FAILED`).  Raises
    ``pydantic.ValidationError`` when ``manifest`` is not a final manifest."""
    m = Manifest.model_validate(manifest)
    where = mask_url(url) if m.folder == "." else mask_url(url.rstrip("/") + "/" + m.folder + "/")
    print(f"{m.status} ({m.reason}): {job} -> {where}")
    for f in m.files:
        print(f"  {f.path}  {f.bytes} bytes  sha256 {f.sha256[:16]}")
    if m.checkpoint:
        print(f"  checkpoint {step_text(m.step)}: {m.checkpoint}")
    return {"completed": EXIT_OK, "partial": EXIT_PARTIAL}.get(m.status, EXIT_FAILED)


def api_error(exc: BaseException) -> bool:
    """True for an error reaching the Prefect API (httpx / Prefect's own)."""
    module = type(exc).__module__
    return module.startswith(("httpx", "httpcore", "prefect")) or "Failed to reach API" in str(exc)
