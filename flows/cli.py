"""The ``e31`` command line.

    e31 validate SPEC [--set FIELD=VALUE ...]   check a spec, print a summary
    e31 schema                                  JSON Schema of the spec to stdout
    e31 compile SPEC [--set ...]                print the plan run_job would execute
    e31 run SPEC [--set ...]                    run the job here, print where the output went
    e31 deploy SPEC --pool P [--cron C --timezone TZ]   a Prefect deployment of the job
    e31 return JOB                              deliver output a run kept in scratch (destination was down)

Exit codes: 0 completed (or valid), 3 partial, 1 failed, 2 invalid spec or
usage.  E31's own errors (:class:`e31.errors.E31Error`) are printed in one
line, without a traceback.  Prefect is imported only by the commands that
need it, so validating is quick.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

from e31 import __version__
from e31.errors import EXIT_FAILED, EXIT_INVALID, EXIT_OK, E31Error, InvalidInput
from e31.flows.apiwords import TALKS, check_server, database_down, refused_credentials
from e31.flows.checks import SpecChecks
from e31.specs import JobSpec, SpecError, json_schema, load_spec, mask_url
from e31.tasks import settings
from e31.flows.runcmd import api_error, cmd_run, print_manifest


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="e31", description="E31: declare a batch job, run it as a Prefect flow.")
    parser.add_argument("--version", action="version", version=f"e31 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in (
        ("validate", "check a job spec and print a summary"),
        ("compile", "print the plan the job's flow executes"),
        ("run", "run the job on this machine and return its output"),
    ):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("spec", help="job spec file (.yaml, .yml or .json)")
        _add_set(cmd)
        if name == "compile":
            cmd.add_argument("--no-list", action="store_true",
                             help="do not list the inputs (their sizes need the stores to be reachable)")
    deploy = sub.add_parser("deploy", help="create a Prefect deployment of the job on a work pool",
                            description="create or update the Prefect deployment e31-job/NAME of the job on a work pool")
    deploy.add_argument("spec", help="job spec file")
    deploy.add_argument("--pool", required=True, help="Prefect work pool (e.g. a process pool: prefect work-pool create P "
                        "--type process), or an E31 pool file (its queue's work pool: the runs join that queue)")
    deploy.add_argument("--cron", help='cron schedule, e.g. "0 2 * * *" (none: runs only when triggered)')
    deploy.add_argument("--timezone", help="IANA timezone of the --cron schedule, e.g. Europe/London (default UTC)")
    deploy.add_argument("--name", help="deployment name (default: the job's name)")
    deploy.add_argument("--tenant", help="with an E31 pool file: the pool's tenant the runs are for (default: the "
                                         "tenant whose members include you, else default)")
    _add_set(deploy)
    sub.add_parser("schema", help="print the JSON Schema of job specs", description="print the JSON Schema of job specs")
    ret = sub.add_parser("return", help="deliver the output a run could not return (kept in scratch)",
                         description="deliver the output a run of JOB could not return to its destination; it was "
                                     "kept in the job's scratch folder ($E31_SCRATCH/JOB)")
    ret.add_argument("job", help="the job's name (its spec's name)")
    from e31.deployments.commands import add_commands  # the queue: the CLI is the one place above every layer
    from e31.flows.placement.commands import add_commands as add_placement_commands  # pool, plan, simulate

    _PLAIN.update(add_commands(sub))
    _PLAIN.update(add_placement_commands(sub))
    return parser


def _add_set(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
        help="override a field by dotted path, e.g. --set request.limit=20s --set output.url=/tmp/out",
    )


def _summary(spec: JobSpec) -> str:
    req = spec.request
    what = spec.work.entrypoint or " ".join(mask_url(arg) for arg in spec.work.command or [])
    limit = req.limit or req.duration
    deadline = (f", deadline {req.deadline.isoformat()}" if req.deadline else
                f", deadline within {req.deadline_within} of the start" if req.deadline_within else
                f", deadline {req.deadline_at} daily" if req.deadline_at else "")
    return (
        f"valid: {spec.name} ({spec.work.kind}: {what}); {len(spec.data)} input(s); "
        f"{f'{req.nodes} nodes, each ' if req.nodes > 1 else ''}{req.gpus} gpu, {req.cpus} cpu, limit {limit}"
        f"{deadline}; output {spec.output.kind} -> "
        f"{mask_url(spec.output.url)}"
    )


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


# -- commands ---------------------------------------------------------------

def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(), indent=2))
    return EXIT_OK


def cmd_validate(args: argparse.Namespace, spec: JobSpec, notes: list[str]) -> int:
    """The spec's summary and notes; a spec larger than this machine is valid (a pool may hold it), with a
    note saying what ``e31 run`` would refuse here and how to check it against a pool."""
    from e31.flows.admission import AdmissionError, check_fits
    from e31.flows.compile import compile_plan
    from e31.specs.preemption import preemption_notes

    print(_summary(spec))
    for note in notes + preemption_notes(spec):
        print(f"note: {note}")
    try:
        check_fits(compile_plan(spec))
    except AdmissionError as exc:
        lines = str(exc).splitlines()
        if len(lines) == 1:  # a request of several nodes: run in a queue only
            print(f"note: e31 run would refuse it: {lines[0]}")
        else:
            print(f"note: e31 run would refuse it on this machine: {'; '.join(line.strip() for line in lines[1:-1])} "
                  "(e31 plan SPEC --pool POOL.yaml checks it against a pool's nodes)")
    except E31Error:  # a setting or a deadline: e31 run reports those itself, validate checks the spec
        pass
    return EXIT_OK


def cmd_compile(args: argparse.Namespace, spec: JobSpec, notes: list[str]) -> int:
    from e31.flows.compile import compile_plan, describe
    from e31.flows.inputs import list_inputs

    plan = compile_plan(spec)
    print(describe(plan))
    print(f"  {preemptible_line(spec)}")
    return EXIT_OK if args.no_list else list_inputs(spec, plan)


def preemptible_line(spec: JobSpec) -> str:
    """Whether a queue may preempt the job, and why (``request.preemptible`` or its default)."""
    from e31.specs.preemption import has_deadline, is_preemptible

    if spec.request.nodes > 1:  # a queue frees room node by node: a gang is never a victim
        return "preemptible: no (a job of several nodes is never preempted)"
    if spec.request.preemptible is not None:
        why = "request.preemptible"
    elif is_preemptible(spec):
        why = "default: it declares checkpoints and no deadline"
    else:
        why = "default: it has a deadline" if has_deadline(spec) else "default: it declares no checkpoints"
    return f"preemptible: {'yes' if is_preemptible(spec) else 'no'} ({why})"


def cmd_return(args: argparse.Namespace) -> int:
    from e31.flows.compile import default_scratch_root
    from e31.flows.joblock import lock_job, unlock_job
    from e31.prefect_compat.tempserver import prefect_api
    from e31.specs.fields import valid_job_name
    from e31.tasks.pending import PENDING, deliver_pending, load_pending
    from e31.tasks.storage import describe_error
    from e31.tasks.storage.credentials import uses_secret_blocks

    job = args.job
    if not valid_job_name(job):
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
    lock_job(str(scratch), job)
    try:
        secrets = uses_secret_blocks(pending.output_options) or uses_secret_blocks((pending.checkpoints or {}).get("options"))
        with prefect_api() if secrets else contextlib.nullcontext():  # Secret blocks need the Prefect API
            manifest = deliver_pending(scratch)
            if manifest is not None:
                from e31.prefect_compat.statesync import remember

                remember(scratch, manifest)  # the interrupted run's flow run gets the manifest's state ...
            if os.environ.get("PREFECT_API_URL") or secrets:
                from e31.prefect_compat.statesync import apply_pending

                apply_pending(default_scratch_root())  # ... now, if an API answers (else at the next e31 run)
    except E31Error as exc:
        print(f"e31: cannot return the output of {job}: {exc}" + (
            "" if "stays in" in str(exc) or "gone" in str(exc) else f"; it stays in {pending.target.output_dir}"),
            file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # the store is still unreachable
        print(f"e31: could not return the output of {job} to {mask_url(pending.target.output_url)}: "
              f"{describe_error(exc, pending.target.output_url)}; it stays in {pending.target.output_dir}; "
              "try again later", file=sys.stderr)
        return EXIT_FAILED
    finally:
        unlock_job(str(scratch))
    return print_manifest(manifest, job, pending.target.output_url)


def cmd_deploy(args: argparse.Namespace, spec: JobSpec, notes: list[str]) -> int:
    from prefect.settings import PREFECT_API_URL

    from e31.flows.deploy import FLOW_NAME, deploy_spec, existing_schedules

    api = PREFECT_API_URL.value()
    if not api:
        print("e31: deploy needs a Prefect server that workers also reach: start one (prefect server start) "
              "and set PREFECT_API_URL", file=sys.stderr)
        return EXIT_FAILED
    timezone = args.timezone or "UTC"
    name = args.name or spec.name
    pool, tags = args.pool, ()
    try:
        if pool.endswith((".yaml", ".yml")) or Path(pool).is_file():  # a pool file, as the queue's commands take
            import getpass

            from e31.flows.queue.mapping import work_pool_name
            from e31.flows.queue.tenancy import TENANT_TAG, choose_tenant
            from e31.specs.pool import load_pool

            declared = load_pool(pool)
            tags = (TENANT_TAG + choose_tenant(declared, args.tenant, getpass.getuser()),)
            pool = work_pool_name(declared)
        elif args.tenant is not None:
            raise InvalidInput(f"--tenant needs an E31 pool file as --pool (got the work pool {pool!r}): tenants are "
                               "declared in a pool file")
        earlier = existing_schedules(f"{FLOW_NAME}/{name}")
        deployment_id = deploy_spec(spec, str(Path(args.spec).resolve().parent), pool=pool, cron=args.cron,
                                    timezone=timezone if args.cron else None, name=args.name, tags=tags)
    except E31Error as exc:
        print(f"e31: deploy refused: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # unknown pool, unreachable API
        from e31.specs import mask_url
        from e31.tasks.storage import scrub

        refused = refused_credentials(exc) or database_down(exc)
        if refused is not None:
            print(f"e31: deploy failed: {refused}", file=sys.stderr)
            return EXIT_FAILED
        network = isinstance(exc, (OSError, ConnectionError)) or type(exc).__module__.startswith(("httpx", "httpcore"))
        reach = f" (the Prefect API at {mask_url(api)})" if api and network else ""
        print(f"e31: deploy failed{reach}: {type(exc).__name__}: {scrub(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    schedule = f"cron {args.cron!r} in {timezone}" if args.cron else "no schedule"
    if not args.cron and earlier:
        schedule += f" (its earlier schedule {', '.join(earlier)} was removed; pass --cron to keep one)"
    tenant = f" for tenant {tags[0].split(':', 1)[1]}" if tags else ""
    print(f"deployed {FLOW_NAME}/{name} ({deployment_id}) on pool {pool}{tenant}, {schedule}")
    return EXIT_OK


#: Commands that take no spec, and those that load one first (the spec is checked, then the command runs).
_PLAIN: dict[str, Callable[[argparse.Namespace], int]] = {"schema": cmd_schema, "return": cmd_return}
_WITH_SPEC: dict[str, Callable[[argparse.Namespace, JobSpec, list[str]], int]] = {
    "validate": cmd_validate, "compile": cmd_compile, "run": cmd_run, "deploy": cmd_deploy,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``e31`` console script; returns the exit code."""
    from e31.prefect_compat.lazytls import install

    install()  # Prefect's clients stop paying ~30 ms of CPU each for a trust store a plain http:// API never uses
    try:
        return _main(argv)
    except BrokenPipeError:  # e.g. `e31 schema | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except E31Error as exc:  # explained in one line
        print(str(exc) if isinstance(exc, SpecError) else f"e31: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # Prefect API unreachable, a bug: one line, the details on request
        if os.environ.get("E31_DEBUG"):
            raise
        from e31.specs import mask_url
        from e31.tasks.storage import scrub

        api = os.environ.get("PREFECT_API_URL")
        refused = refused_credentials(exc) or database_down(exc)
        if refused is not None:
            print(f"e31: {refused}", file=sys.stderr)
            return EXIT_FAILED
        hint = (f" (PREFECT_API_URL={mask_url(api)}): is the Prefect server running? Start it (prefect server start) "
                "or point PREFECT_API_URL at it" if api and api_error(exc) else "")
        print(f"e31: {type(exc).__name__}: {scrub(str(exc))}{hint}; set E31_DEBUG=1 for the traceback", file=sys.stderr)
        return EXIT_FAILED


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command in _PLAIN:
        if args.command in TALKS:
            check_server()
        return _PLAIN[args.command](args)
    settings.check()
    checks = SpecChecks(code_dir=str(Path(args.spec).resolve().parent))
    spec = load_spec(args.spec, overrides=args.overrides, checks=checks)
    vanishing = _in_memory_outputs(spec) if args.command in ("run", "deploy") else []
    if vanishing:
        print("\n".join(f"e31: {line}" for line in vanishing), file=sys.stderr)
        return EXIT_INVALID
    if args.command == "deploy":  # its schedule too
        from e31.flows.deploy import schedule_problems

        problems = schedule_problems(spec, args.cron, args.timezone)
        if problems:
            print("\n".join(f"e31: deploy refused: {line}" for line in problems), file=sys.stderr)
            return EXIT_INVALID
    if args.command in TALKS:  # the spec first: its errors are the user's to fix whatever the server does
        check_server()
    return _WITH_SPEC[args.command](args, spec, checks.notes)


if __name__ == "__main__":
    sys.exit(main())
