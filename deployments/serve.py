"""Serve E31 job deployments from this one process, without a work pool.

    python -m deployments.serve [SPEC ...] [--cron "0 2 * * *"] [--timezone Europe/London]

Each SPEC (default: the nightly retrain example) becomes a deployment
``e31-job/<name>`` with the cron schedule; runs happen in subprocesses of
this process while it runs (stopping it pauses the schedules).  For a work
pool with workers, use ``prefect deploy --all --prefect-file
deployments/prefect.yaml`` or ``e31 deploy``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flows.deploy import job_tags, parameters, schedules
from specs import SpecError, load_spec

EXAMPLE = Path(__file__).resolve().parents[1] / "specs" / "examples" / "digits-nightly-retrain.yaml"


def main(argv: list[str] | None = None) -> int:
    """Build the deployments and serve them until interrupted; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m deployments.serve", description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", default=[str(EXAMPLE)], help="job spec files (default: the nightly retrain)")
    parser.add_argument("--cron", default="0 2 * * *", help="cron schedule (default: 02:00 every day)")
    parser.add_argument("--timezone", default="Europe/London", help="IANA timezone of the schedule")
    args = parser.parse_args(argv)
    from flows.job import run_job
    from prefect import serve

    deployments = []
    for path in args.specs:
        try:
            spec = load_spec(path)
        except SpecError as exc:
            print(str(exc), file=sys.stderr)
            return 2
        deployments.append(run_job.to_deployment(
            name=spec.name, parameters=parameters(spec, str(Path(path).resolve().parent)),
            schedules=schedules(args.cron, args.timezone), tags=job_tags(spec),
        ))
    serve(*deployments)
    return 0


if __name__ == "__main__":
    sys.exit(main())
