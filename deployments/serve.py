"""Serve E31 job deployments from this one process, without a work pool.

    python -m e31.deployments.serve [SPEC ...] [--cron "0 2 * * *"] [--timezone Europe/London] [--name NAME]

Each SPEC (default: the nightly retrain example) becomes a deployment
``e31-job/<name>`` with the cron schedule; runs happen in subprocesses of
this process while it runs (stopping it pauses the schedules).  For a work
pool with workers, use ``prefect deploy --all --prefect-file
deployments/prefect.yaml`` or ``e31 deploy``.

Serving never takes over a deployment that ``prefect deploy`` or ``e31
deploy`` made on a work pool (serving would rewrite it, and pause it when
this process stops): such a name is refused, with the fix (``--name``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from e31.errors import E31Error
from e31.flows.deploy import FLOW_NAME, job_tags, parameters, schedules
from e31.specs import SpecError, load_spec

EXAMPLE = Path(__file__).resolve().parents[1] / "specs" / "examples" / "digits-nightly-retrain.yaml"


def pooled_deployment(name: str) -> str | None:
    """The work pool of the existing deployment ``e31-job/<name>`` when it was
    made for a work pool (by ``prefect deploy`` or ``e31 deploy``), else None
    (no such deployment, or one that a serve process made)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            found = client.read_deployment_by_name(f"{FLOW_NAME}/{name}")
        except ObjectNotFound:
            return None
    return found.work_pool_name or None


def main(argv: list[str] | None = None) -> int:
    """Build the deployments and serve them until interrupted; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m e31.deployments.serve", description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", default=[str(EXAMPLE)], help="job spec files (default: the nightly retrain)")
    parser.add_argument("--cron", default="0 2 * * *", help="cron schedule (default: 02:00 every day)")
    parser.add_argument("--timezone", default="Europe/London", help="IANA timezone of the schedule")
    parser.add_argument("--name", help="deployment name (one SPEC only; default: the job's name)")
    args = parser.parse_args(argv)
    if args.name and len(args.specs) != 1:
        print("e31: --name names one deployment: give exactly one SPEC with it", file=sys.stderr)
        return 2
    from prefect import serve

    from e31.flows.job import run_job

    deployments = []
    for path in args.specs:
        try:
            spec = load_spec(path)
        except SpecError as exc:
            print(str(exc), file=sys.stderr)
            return 2
        name = args.name or spec.name
        pool = pooled_deployment(name)
        if pool is not None:
            print(f"e31: serve refused: the deployment {FLOW_NAME}/{name} runs on the work pool {pool!r} (made by "
                  f"prefect deploy or e31 deploy); serving it here would replace it and pause it when this process "
                  f"stops. Serve under another name: --name {name}-served", file=sys.stderr)
            return 2
        try:
            params = parameters(spec, str(Path(path).resolve().parent))
        except E31Error as exc:
            print(f"e31: serve refused: {exc}", file=sys.stderr)
            return exc.exit_code
        deployments.append(run_job.to_deployment(
            name=name, parameters=params, schedules=schedules(args.cron, args.timezone), tags=job_tags(spec),
        ))
    serve(*deployments)
    return 0


if __name__ == "__main__":
    sys.exit(main())
