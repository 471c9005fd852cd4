"""Deployments of ``run_job`` for a job spec: the spec travels through the
Prefect API as the flow's typed ``spec`` parameter (its schema in the UI is
the spec's JSON Schema), with a cron schedule in a named timezone.

Used by ``e31 deploy`` (to a work pool; :func:`schedule_problems` checks its
``--cron``/``--timezone`` first) and ``deployments/serve.py`` (served from
one process, no work pool).
"""

from __future__ import annotations

from typing import Any

from e31.errors import InvalidInput
from e31.specs import JobSpec, secrets_in, spec_payload

#: The deployment entrypoint: a module path, so a worker loads the installed ``e31`` package
#: (editable or from a wheel) from any working folder, with no code storage or pull step.
ENTRYPOINT = "e31.flows.job:run_job"
#: The flow's name: deployments are ``e31-job/<name>``.
FLOW_NAME = "e31-job"


def job_tags(spec: JobSpec) -> list[str]:
    """Prefect tags for a job's runs: its work kind and its request, e.g.
    ``["e31", "kind:training", "gpus:0", "cpus:1"]``."""
    return ["e31", f"kind:{spec.work.kind}", f"gpus:{spec.request.gpus}", f"cpus:{spec.request.cpus}"]


class SecretInSpecError(InvalidInput):
    """A spec holding a credential (a signed URL) cannot be deployed: its
    parameters would be stored on the Prefect server."""


def parameters(spec: JobSpec, code_dir: str | None) -> dict[str, Any]:
    """The flow run parameters for ``spec`` (JSON-ready).  Raises
    :class:`SecretInSpecError` naming the fields when a URL carries a credential
    (a presigned signature, a token): deployment parameters are stored on
    the server and shown in the UI, and a masked URL would not work."""
    leaks = secrets_in(spec)
    if leaks:
        raise SecretInSpecError(
            f"{', '.join(leaks)}: the URL carries a credential (a signature or token) and deployment parameters are "
            "stored on the Prefect server; use the store's own URL instead (e.g. s3://bucket/key rather than a "
            "presigned https:// URL) with its credentials in the worker's environment or in storage_options as "
            "references ({secret: BLOCK_NAME} or {env: VAR})"
        )
    return {"spec": spec_payload(spec, reveal=True), "code_dir": code_dir}


def schedules(cron: str | None, timezone: str | None) -> list | None:
    """A one-element schedule list for ``cron`` in ``timezone`` (IANA name;
    Prefect's cron schedules follow local wall-clock time across DST
    changes), or None without ``cron``.  Raises ``ValueError`` for a bad cron
    string or timezone."""
    if not cron:
        return None
    from prefect.schedules import Cron

    return [Cron(cron, timezone=timezone)]


def deploy_spec(
    spec: JobSpec, code_dir: str | None, *, pool: str, cron: str | None = None, timezone: str | None = None,
    name: str | None = None, tags: tuple[str, ...] = (),
) -> str:
    """Create or update the deployment ``e31-job/<name or spec.name>`` on the
    work pool ``pool``; returns its id.  Its entrypoint is the module path
    :data:`ENTRYPOINT`: every worker of the pool runs the ``e31`` installed
    in its own environment, from any working folder.  ``code_dir`` (work
    code beside the spec) must be visible to the workers (one machine, or a
    shared filesystem).  ``tags``: more tags for its runs (a pool's tenant, ``tenant:NAME``)."""
    from prefect.deployments.runner import RunnerDeployment

    from e31.flows.job import run_job

    deployment = RunnerDeployment.from_flow(
        run_job,
        name=name or spec.name,
        parameters=parameters(spec, code_dir),
        schedules=schedules(cron, timezone),
        tags=[*job_tags(spec), *tags],
        description=f"E31 job {spec.name}: {spec.work.kind}, output {spec.output.kind}",
        work_pool_name=pool,
    )
    deployment.entrypoint = ENTRYPOINT
    return str(deployment.apply(work_pool_name=pool))


def schedule_problems(spec: JobSpec, cron: str | None, timezone: str | None) -> list[str]:
    """What is wrong with a deployment's ``--cron`` / ``--timezone`` for
    ``spec``, before anything is sent to the server: a timezone without a
    cron, an empty or invalid cron string (five fields, or an @daily-style
    name; a sixth, seconds field would start a run every second) or IANA timezone,
    and an absolute ``request.deadline`` on a schedule (every run after it
    would be refused).  Returns one line per problem, [] when none."""
    problems = []
    if timezone is not None and cron is None:
        problems.append("--timezone applies to a --cron schedule; give --cron too (e.g. --cron '0 2 * * *')")
    from prefect.client.schemas.schedules import CronSchedule  # Prefect's own checks of both

    if timezone is not None and not (timezone.strip() and _valid(CronSchedule, cron="0 0 * * *", timezone=timezone)):
        problems.append(f"--timezone {timezone!r} is not an IANA timezone; e.g. UTC, Europe/London, America/New_York")
    if cron is not None:
        five = cron.strip().startswith("@") or len(cron.split()) == 5  # Prefect also takes a 6th field: seconds
        if not (five and _valid(CronSchedule, cron=cron)):
            problems.append(f"--cron {cron!r} is not a cron schedule; five fields: minute hour day-of-month month "
                            "day-of-week, e.g. '0 2 * * *' (02:00 every day)")
        if spec.request.deadline is not None:
            problems.append(f"request.deadline {spec.request.deadline.isoformat()} is one moment, and every scheduled "
                            "run after it would be refused; for a schedule use request.deadline_within (e.g. 4h after "
                            "each scheduled start) or request.deadline_at (e.g. \"06:00 Europe/London\")")
    return problems


def _valid(model: Any, **fields: Any) -> bool:
    try:
        model(**fields)
    except ValueError:  # pydantic's ValidationError included
        return False
    return True


def existing_schedules(deployment: str) -> list[str]:
    """The cron schedules (``'0 2 * * *' in Europe/London``) of an existing
    deployment, or [] when there is none by that name."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            found = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            return []
    return [f"cron {getattr(s.schedule, 'cron', s.schedule)!r} in {getattr(s.schedule, 'timezone', None) or 'UTC'}"
            for s in found.schedules]
