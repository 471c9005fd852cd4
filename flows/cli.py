"""The ``e31`` command line.

    e31 validate SPEC [--set FIELD=VALUE ...]   check a spec, print a summary
    e31 schema                                  JSON Schema of the spec to stdout
    e31 compile SPEC [--set ...]                print the plan run_job would execute
    e31 run SPEC [--set ...]                    run the job here, print where the output went
    e31 deploy SPEC --pool P [--cron C --timezone TZ]   a Prefect deployment of the job
    e31 return JOB                              deliver output a run kept in scratch (destination was down)

Exit codes: 0 completed (or valid), 3 partial, 1 failed, 2 invalid spec or
usage.  Errors are printed without a traceback.  Prefect is imported only by
``run``, so validating is quick.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path

from specs import JobSpec, SpecError, json_schema, load_spec, mask_url
from tasks import settings

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_PARTIAL = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="e31", description="E31: declare a batch job, run it as a Prefect flow.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in (
        ("validate", "check a job spec and print a summary"),
        ("compile", "print the plan the job's flow executes"),
        ("run", "run the job on this machine and return its output"),
    ):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("spec", help="job spec file (.yaml, .yml or .json)")
        cmd.add_argument(
            "--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
            help="override a field by dotted path, e.g. --set request.limit=20s --set output.url=/tmp/out",
        )
        if name == "compile":
            cmd.add_argument("--no-list", action="store_true",
                             help="do not list the inputs (their sizes need the stores to be reachable)")
    deploy = sub.add_parser("deploy", help="create a Prefect deployment of the job on a work pool",
                            description="create or update the Prefect deployment e31-job/NAME of the job on a work pool")
    deploy.add_argument("spec", help="job spec file")
    deploy.add_argument("--pool", required=True, help="Prefect work pool (e.g. a process pool: prefect work-pool create P --type process)")
    deploy.add_argument("--cron", help='cron schedule, e.g. "0 2 * * *" (none: runs only when triggered)')
    deploy.add_argument("--timezone", help="IANA timezone of the --cron schedule, e.g. Europe/London (default UTC)")
    deploy.add_argument("--name", help="deployment name (default: the job's name)")
    deploy.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a field by dotted path")
    sub.add_parser("schema", help="print the JSON Schema of job specs", description="print the JSON Schema of job specs")
    ret = sub.add_parser("return", help="deliver the output a run could not return (kept in scratch)",
                         description="deliver the output a run of JOB could not return to its destination; it was "
                                     "kept in the job's scratch folder ($E31_SCRATCH/JOB)")
    ret.add_argument("job", help="the job's name (its spec's name)")
    return parser


def _summary(spec: JobSpec) -> str:
    req = spec.request
    what = spec.work.entrypoint or " ".join(mask_url(arg) for arg in spec.work.command or [])
    limit = req.limit or req.duration
    return (
        f"valid: {spec.name} ({spec.work.kind}: {what}); {len(spec.data)} input(s); "
        f"{req.gpus} gpu, {req.cpus} cpu, limit {limit}; output {spec.output.kind} -> {mask_url(spec.output.url)}"
    )


def _run(spec: JobSpec, spec_path: str) -> int:
    from flows.tempserver import prefect_api

    try:
        with prefect_api():
            return _run_with_api(spec, spec_path)
    except KeyboardInterrupt:
        print("e31: interrupted before the run started; nothing ran", file=sys.stderr)
        return 130
    except Exception as exc:  # Prefect API unreachable, a bug: one line, the details on request
        if os.environ.get("E31_DEBUG"):
            raise
        api = os.environ.get("PREFECT_API_URL")
        hint = f" (PREFECT_API_URL={api})" if api and _api_error(exc) else ""
        print(f"e31: {type(exc).__name__}: {exc}{hint}; set E31_DEBUG=1 for the traceback", file=sys.stderr)
        return EXIT_FAILED


def _api_error(exc: BaseException) -> bool:
    """True for an error reaching the Prefect API (httpx / Prefect's own)."""
    module = type(exc).__module__
    return module.startswith(("httpx", "httpcore", "prefect")) or "Failed to reach API" in str(exc)


def _run_with_api(spec: JobSpec, spec_path: str) -> int:
    from prefect import tags

    from flows.compile import compile_plan
    from flows.deploy import job_tags
    from flows.job import JobFailed, ReturnFailed, run_job
    from flows.placement import PlacementError, check_fits
    from flows.resume import JobBusy
    from tasks.deliver import DestinationError
    from tasks.outcome import ChildLost
    from tasks.stage import StageError

    from tasks.credentials import CredentialError

    expected = (JobFailed, StageError, PlacementError, DestinationError, JobBusy, ReturnFailed, CredentialError)
    _hide_tracebacks_on_console((*expected, ChildLost))
    try:
        check_fits(compile_plan(spec))  # refuse before a flow run exists
        with tags(*job_tags(spec)):
            manifest = run_job(spec, code_dir=str(Path(spec_path).resolve().parent))
    except JobFailed as exc:
        print(f"e31: {exc}", file=sys.stderr)
        m = exc.manifest
        kept = f"{len(m['files'])} file(s)" + (f" and the checkpoint of step {m['step']}" if m.get("checkpoint") else "")
        print(f"failed: {kept} returned to {mask_url(spec.output.url)}", file=sys.stderr)
        return EXIT_FAILED
    except expected as exc:
        print(f"e31: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except settings.SettingsError as exc:
        print(f"e31: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        print("e31: interrupted; see the destination's manifest.json for what came back", file=sys.stderr)
        return 130
    return _print_manifest(manifest, spec.name, spec.output.url)


STAGE_RATE_MIBS = settings.value("E31_STAGE_RATE_MIBS")  # assumed staging rate for estimates (MiB/s)


def _list_data(spec: JobSpec, plan) -> int:
    """Preflight of ``e31 compile``: list every input (sizes, file counts)
    and estimate the staging time at :data:`STAGE_RATE_MIBS`."""
    from tasks.credentials import CredentialError, uses_secret_blocks
    from tasks.stage import StageError, preflight
    from tasks.storage_setup import register_storage
    from tasks.transferbar import _human

    if not spec.data:
        return EXIT_OK
    try:
        needs_api = any(uses_secret_blocks(options) for options in (
            *(d.storage_options for d in spec.data), spec.output.storage_options,
            spec.output.checkpoint.storage_options if spec.output.checkpoint else None))
        if needs_api:
            from flows.tempserver import prefect_api

            with prefect_api():
                register_storage(spec, plan)
        else:
            register_storage(spec, plan)
        listings = preflight(plan.inputs)
    except (StageError, CredentialError) as exc:
        print(f"e31: {exc}", file=sys.stderr)
        return EXIT_FAILED
    total = sum(x.bytes for x in listings.values())
    files = sum(len(x.entries) for x in listings.values())
    seconds = total / (STAGE_RATE_MIBS * 2**20)
    print(f"  data: {len(listings)} input(s), {files} file(s), {_human(total)} ({total} bytes); "
          f"~{_duration(seconds)} to stage at {STAGE_RATE_MIBS:g} MiB/s")
    for name, x in listings.items():
        print(f"    {name}: {x.kind}, {len(x.entries)} file(s), {_human(x.bytes)}")
    return EXIT_OK


def _unusable_urls(spec: JobSpec) -> list[str]:
    """``field: masked URL: reason`` for each URL of the spec whose fsspec
    backend is unknown or not installed here (nothing is contacted)."""
    from tasks.storage import backend_problem

    urls = [(f"data[{i}].url", d.url) for i, d in enumerate(spec.data)] + [("output.url", spec.output.url)]
    if spec.output.checkpoint and spec.output.checkpoint.url:
        urls.append(("output.checkpoint.url", spec.output.checkpoint.url))
    return [f"{field}: {mask_url(url)}: {problem}" for field, url in urls if (problem := backend_problem(url))]


def _in_memory_outputs(spec: JobSpec) -> list[str]:
    """``field: URL: reason`` for an output or checkpoint URL on fsspec's
    ``memory://`` filesystem, which lives in one process: a job run by
    ``e31 run`` or a deployment's worker would return into memory that is
    gone when that process ends (calling the flow from Python can use it)."""
    urls = [("output.url", spec.output.url)]
    if spec.output.checkpoint and spec.output.checkpoint.url:
        urls.append(("output.checkpoint.url", spec.output.checkpoint.url))
    return [f"{field}: {mask_url(url)}: memory:// lives only inside one Python process and would be gone when this "
            "run ends; return to a folder or an object store (s3://, gs://, az://)"
            for field, url in urls if url.split("::")[-1].lower().startswith("memory://")]


def _duration(seconds: float) -> str:
    """``seconds`` as ``12 s``, ``35 min``, ``7.5 h`` or ``3.2 d``."""
    for unit, size, limit in (("s", 1, 120), ("min", 60, 120 * 60), ("h", 3600, 72 * 3600)):
        if seconds < limit:
            return f"{seconds / size:.0f} {unit}" if unit != "h" else f"{seconds / size:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _return_later(job: str) -> int:
    from flows.compile import default_scratch_root
    from flows.job import KeptOutputGone, deliver_pending
    from flows.resume import JobBusy, lock_job, unlock_job
    from specs.fields import SAFE_NAME
    from tasks.credentials import CredentialError, uses_secret_blocks
    from flows.tempserver import prefect_api
    from tasks.pending import PENDING, load_pending, pending_checkpoints

    if not re.fullmatch(SAFE_NAME, job) or len(job) > 63:
        print(f"e31: return: {job!r} is not a job name (1-63 letters, digits, '.', '_', '-'; the spec's name, "
              "not a path)", file=sys.stderr)
        return EXIT_INVALID
    scratch = default_scratch_root() / job
    try:
        pending = load_pending(scratch)
    except (ValueError, KeyError, TypeError) as exc:
        print(f"e31: {scratch / PENDING} is unreadable ({exc}); the output is in {scratch / 'output'}", file=sys.stderr)
        return EXIT_FAILED
    if pending is None:
        print(f"e31: nothing to return for {job}: no {PENDING} in {scratch} (E31_SCRATCH={default_scratch_root()})",
              file=sys.stderr)
        return EXIT_FAILED
    target = pending[0]
    try:
        lock_job(str(scratch), job)
    except JobBusy as exc:
        print(f"e31: {exc}", file=sys.stderr)
        return EXIT_FAILED
    try:
        secrets = uses_secret_blocks(pending[2]) or uses_secret_blocks((pending_checkpoints(scratch) or {}).get("options"))
        with prefect_api() if secrets else _nothing():  # Secret blocks need the Prefect API
            manifest = deliver_pending(scratch)
    except KeptOutputGone as exc:
        print(f"e31: cannot return the output of {job}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except CredentialError as exc:
        print(f"e31: cannot return the output of {job}: {exc}; it stays in {target.output_dir}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:
        from tasks.storage import scrub

        print(f"e31: could not return the output of {job} to {mask_url(target.output_url)}: {type(exc).__name__}: "
              f"{scrub(str(exc))}; it stays in {target.output_dir}; try again later", file=sys.stderr)
        return EXIT_FAILED
    finally:
        unlock_job(str(scratch))
    return _print_manifest(manifest, job, target.output_url)


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _print_manifest(manifest: dict, job: str, url: str) -> int:
    print(f"{manifest['status']} ({manifest['reason']}): {job} -> {mask_url(url)}")
    for f in manifest["files"]:
        print(f"  {f['path']}  {f['bytes']} bytes  sha256 {f['sha256'][:16]}")
    if manifest.get("checkpoint"):
        print(f"  checkpoint step {manifest['step']}: {manifest['checkpoint']}")
    return {"completed": EXIT_OK, "partial": EXIT_PARTIAL}.get(manifest["status"], EXIT_FAILED)


def _deploy(spec: JobSpec, args: argparse.Namespace) -> int:
    from prefect.settings import PREFECT_API_URL

    from flows.deploy import SecretInSpec, deploy_spec, existing_schedules, schedule_problems

    problems = schedule_problems(spec, args.cron, args.timezone)
    if problems:
        print("\n".join(f"e31: deploy refused: {line}" for line in problems), file=sys.stderr)
        return EXIT_INVALID
    api = PREFECT_API_URL.value()
    if not api:
        print("e31: deploy needs a Prefect server that workers also reach: start one (prefect server start) "
              "and set PREFECT_API_URL", file=sys.stderr)
        return EXIT_FAILED
    timezone = args.timezone or "UTC"
    name = args.name or spec.name
    try:
        earlier = existing_schedules(f"e31-job/{name}")
        deployment_id = deploy_spec(spec, str(Path(args.spec).resolve().parent), pool=args.pool, cron=args.cron,
                                    timezone=timezone if args.cron else None, name=args.name)
    except SecretInSpec as exc:
        print(f"e31: deploy refused: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as exc:  # unknown pool, unreachable API
        reach = f" (the Prefect API at {api})" if isinstance(exc, (OSError, ConnectionError)) or \
            type(exc).__module__.startswith(("httpx", "httpcore")) else ""
        print(f"e31: deploy failed{reach}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    schedule = f"cron {args.cron!r} in {timezone}" if args.cron else "no schedule"
    if not args.cron and earlier:
        schedule += f" (its earlier schedule {', '.join(earlier)} was removed; pass --cron to keep one)"
    print(f"deployed e31-job/{name} ({deployment_id}) on pool {args.pool}, {schedule}")
    return EXIT_OK


class _QuietFormatter(logging.Formatter):
    """Wraps the console handler's formatter: a log record carrying one of
    E31's own errors (already explained in one line) is shown without its
    traceback.  Other handlers (the Prefect API's log) keep the traceback."""

    def __init__(self, inner: logging.Formatter, quiet: tuple[type[BaseException], ...]):
        super().__init__()
        self.inner, self.quiet = inner, quiet

    def format(self, record: logging.LogRecord) -> str:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, self.quiet) or _storage_error(exc):
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        return self.inner.format(record)


#: Modules of storage clients whose errors (an endpoint down, throttling) are
#: logged in one line on the console: the traceback says nothing more.
_STORAGE_CLIENTS = ("botocore.", "aiobotocore.", "aiohttp.", "fsspec.", "s3fs.", "gcsfs.", "adlfs.", "azure.")


def _storage_error(exc: BaseException | None) -> bool:
    return exc is not None and (isinstance(exc, OSError) or type(exc).__module__.startswith(_STORAGE_CLIENTS))


def _hide_tracebacks_on_console(quiet: tuple[type[BaseException], ...]) -> None:
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not isinstance(handler.formatter, _QuietFormatter):
            handler.setFormatter(_QuietFormatter(handler.formatter or logging.Formatter(), quiet))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``e31`` console script; returns the exit code."""
    try:
        return _main(argv)
    except BrokenPipeError:  # e.g. `e31 schema | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "schema":
        print(json.dumps(json_schema(), indent=2))
        return EXIT_OK
    if args.command == "return":
        return _return_later(args.job)
    try:
        spec = load_spec(args.spec, overrides=args.overrides)
    except SpecError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_INVALID
    unusable = _unusable_urls(spec)
    if unusable:
        print("\n".join(f"e31: {line}" for line in unusable), file=sys.stderr)
        return EXIT_INVALID
    if args.command == "validate":
        print(_summary(spec))
        return EXIT_OK
    vanishing = _in_memory_outputs(spec) if args.command in ("run", "deploy") else []
    if vanishing:
        print("\n".join(f"e31: {line}" for line in vanishing), file=sys.stderr)
        return EXIT_INVALID
    if args.command == "deploy":
        return _deploy(spec, args)
    if args.command == "compile":
        from flows.compile import SettingsError, compile_plan, describe

        try:
            plan = compile_plan(spec)
        except SettingsError as exc:
            print(f"e31: {exc}", file=sys.stderr)
            return EXIT_INVALID
        print(describe(plan))
        return EXIT_OK if args.no_list else _list_data(spec, plan)
    return _run(spec, args.spec)


if __name__ == "__main__":
    sys.exit(main())
