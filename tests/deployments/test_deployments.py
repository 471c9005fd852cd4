"""Deployments on a real Prefect server: e31 deploy, prefect.yaml, a
process worker running a deployed job, and the nightly schedule across DST."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import yaml

from e31.specs import load_spec
from tests.conftest import final_manifest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "specs" / "examples" / "digits-nightly-retrain.yaml"
PREFECT = [sys.executable, "-m", "prefect"]
LONDON = ZoneInfo("Europe/London")


def test_nightly_schedule_keeps_one_run_a_night_across_dst_changes():
    from prefect.server.schemas.schedules import CronSchedule

    schedule = CronSchedule(cron="0 2 * * *", timezone="Europe/London")
    for first_day in (datetime(2026, 10, 22, 12, tzinfo=LONDON), datetime(2027, 3, 25, 12, tzinfo=LONDON)):
        dates = asyncio.run(schedule.get_dates(n=7, start=first_day))
        local = [d.astimezone(LONDON) for d in dates]
        assert [(d.date(), d.hour, d.minute) for d in local] == [
            (first_day.date() + timedelta(days=i), 2, 0) for i in range(1, 8)
        ]
        offsets = sorted({d.utcoffset().total_seconds() / 3600 for d in local})
        assert offsets == [0.0, 1.0]  # the change happened inside the week, and no night was doubled or dropped


def _deployment(name: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        try:
            return client.read_deployment_by_name(name)
        except Exception:
            return None


def test_deploy_refuses_an_invalid_spec_and_creates_nothing(prefect_api, e31, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("gpus: 0", "gpus: -1").replace("name: digits-nightly-retrain", "name: bad-deploy"))
    result = e31("deploy", str(bad), "--pool", "nowhere", "--cron", "0 2 * * *")
    assert result.returncode == 2
    assert result.stderr.splitlines()[1] == "  request.gpus: must be >= 0 (got -1)"
    assert _deployment("e31-job/bad-deploy") is None


def test_deploy_refuses_a_signed_url_and_creates_nothing(prefect_api, e31, tmp_path):
    signed = "https://store.example/digits.csv.gz?X-Amz-Credential=AKIA1&X-Amz-Signature=deadbeefcafe"
    result = e31("deploy", str(EXAMPLE), "--pool", "nowhere", "--name", "signed-deploy",
                 "--set", f"data[0].url={signed}")
    assert result.returncode == 2
    assert result.stderr == (
        "e31: deploy refused: data[0].url: the URL carries a credential (a signature or token) and deployment "
        "parameters are stored on the Prefect server; use the store's own URL instead (e.g. s3://bucket/key rather "
        "than a presigned https:// URL) with its credentials in the worker's environment or in storage_options as "
        "references ({secret: BLOCK_NAME} or {env: VAR})\n")
    assert "deadbeefcafe" not in result.stdout + result.stderr
    assert _deployment("e31-job/signed-deploy") is None


def test_deploy_then_a_worker_runs_it_with_an_equal_spec(process_worker, e31, tmp_path):
    out = tmp_path / "out"
    result = e31("deploy", str(EXAMPLE), "--pool", process_worker, "--cron", "0 2 * * *", "--timezone", "Europe/London",
                 "--name", "nightly-test", "--set", f"output.url={out}")
    assert result.returncode == 0, result.stderr
    last = result.stdout.splitlines()[-1]  # after Prefect's own table of the deployment
    assert last.startswith("deployed e31-job/nightly-test (")
    assert last.endswith(f"on pool {process_worker}, cron '0 2 * * *' in Europe/London")
    deployment = _deployment("e31-job/nightly-test")
    spec = load_spec(EXAMPLE, overrides=[f"output.url={out}"])
    assert deployment.parameters["spec"] == spec.model_dump(mode="json")
    assert deployment.tags == ["e31", "kind:training", "gpus:0", "cpus:1"]
    (schedule,) = deployment.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone) == ("0 2 * * *", "Europe/London")
    # the parameter form in the UI is the spec's own schema
    schema = deployment.parameter_openapi_schema
    assert schema["properties"]["spec"]["$ref"].endswith("/JobSpec")
    assert set(schema["definitions"]["JobSpec"]["properties"]) == {"spec_version", "name", "work", "data", "request", "output"}

    # a manual run gets the same spec a scheduled one would, and the worker completes it
    run = subprocess.run([*PREFECT, "deployment", "run", "e31-job/nightly-test"], capture_output=True, text=True, check=True)
    deadline = time.monotonic() + 180
    while final_manifest(out) is None:
        assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
        time.sleep(0.5)
    manifest = final_manifest(out)
    assert (manifest["status"], manifest["step"]) == ("completed", 30)
    assert [f["path"] for f in manifest["files"]] == ["metrics.json", "model.pt"]
    assert "Created flow run" in run.stdout or "flow run" in run.stdout.lower()


def test_prefect_yaml_deploys_the_nightly_retrain(prefect_api, tmp_path):
    subprocess.run([*PREFECT, "work-pool", "create", "e31-process", "--type", "process"], capture_output=True)
    result = subprocess.run([*PREFECT, "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    deployment = _deployment("e31-job/digits-nightly-retrain")
    (schedule,) = deployment.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone) == ("0 2 * * *", "Europe/London")
    deployed = deployment.parameters["spec"]
    example = yaml.safe_load(EXAMPLE.read_text())
    assert deployed["work"] == example["work"] and deployed["request"] == example["request"]
    assert deployed["data"][0]["sha256"] == example["data"][0]["sha256"]


def _served_with(name: str, cron: str) -> bool:
    deployment = _deployment(f"e31-job/{name}")
    return deployment is not None and [(s.schedule.cron, s.schedule.timezone) for s in deployment.schedules] == [
        (cron, "Europe/London")
    ]


def test_serve_serves_the_nightly_deployment_without_a_pool(prefect_api, tmp_path):
    name = "digits-nightly-retrain-served"
    proc = subprocess.Popen([sys.executable, "-m", "e31.deployments.serve", str(EXAMPLE), "--cron", "30 1 * * *",
                             "--name", name], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not _served_with(name, "30 1 * * *"):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.5)
        deployment = _deployment(f"e31-job/{name}")
        assert deployment.parameters["spec"] == load_spec(EXAMPLE).model_dump(mode="json")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_serve_never_takes_over_a_deployment_made_for_a_work_pool(prefect_api, e31, tmp_path):
    """Serving the example must not re-register the deployment `prefect
    deploy` had made: after serve stopped it stayed paused with its pull
    steps gone, and the nightly run silently stopped."""
    subprocess.run([*PREFECT, "work-pool", "create", "serve-pool", "--type", "process"], capture_output=True)
    assert e31("deploy", str(EXAMPLE), "--pool", "serve-pool", "--name", "pooled-nightly",
               "--cron", "0 2 * * *", "--timezone", "Europe/London").returncode == 0
    before = _deployment("e31-job/pooled-nightly")
    result = subprocess.run([sys.executable, "-m", "e31.deployments.serve", str(EXAMPLE), "--name", "pooled-nightly"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == (
        "e31: serve refused: the deployment e31-job/pooled-nightly runs on the work pool 'serve-pool' (made by prefect "
        "deploy or e31 deploy); serving it here would replace it and pause it when this process stops. Serve under "
        "another name: --name pooled-nightly-served\n")
    after = _deployment("e31-job/pooled-nightly")
    assert (after.work_pool_name, after.paused, after.updated) == ("serve-pool", False, before.updated)


def test_a_literal_credential_typed_into_a_run_form_is_refused_before_it_is_stored(prefect_api, e31, tmp_path):
    """A run created from a deployment with a literal secret in
    storage_options must not be stored as a parameter on the server and
    refused only by the worker.  The parameter schema makes
    the server refuse it (HTTP 409) and store nothing; a reference passes."""
    import httpx
    from prefect.client.orchestration import get_client

    subprocess.run([*PREFECT, "work-pool", "create", "form-pool", "--type", "process"], check=True, capture_output=True)
    result = e31("deploy", str(EXAMPLE), "--pool", "form-pool", "--name", "form-secret")
    assert result.returncode == 0, result.stderr
    deployment = _deployment("e31-job/form-secret")
    spec = dict(deployment.parameters["spec"])
    planted = "literal-pw-9f3c2a"
    with get_client(sync_client=True) as client:
        for options in ({"secret": planted}, {"Secret-Access-Key": planted, "endpoint_url": "http://127.0.0.1:9"},
                        {"client_kwargs": {"headers": {"Authorization": f"Bearer {planted}"}}}):
            spec["output"] = {**spec["output"], "storage_options": options}
            try:
                client.create_flow_run_from_deployment(deployment.id, parameters={"spec": spec})
                raise AssertionError(f"accepted {options}")
            except httpx.HTTPStatusError as exc:
                assert exc.response.status_code == 409
                assert "storage_options" in exc.response.text
        for field, url in (("output", f"s3://user:{planted}@bucket/out/"),
                           ("data", f"https://store.example/t.csv?X-Amz-Signature={planted}")):
            bad = dict(spec)
            if field == "output":
                bad["output"] = {**spec["output"], "url": url}
            else:
                bad["data"] = [{**spec["data"][0], "url": url}]
            try:
                client.create_flow_run_from_deployment(deployment.id, parameters={"spec": bad})
                raise AssertionError(f"accepted {field} {url}")
            except httpx.HTTPStatusError as exc:
                assert exc.response.status_code == 409
        spec["output"] = {**spec["output"], "storage_options": {"secret": {"env": "E31_TEST_SECRET"}, "anon": False}}
        accepted = client.create_flow_run_from_deployment(deployment.id, parameters={"spec": spec})
        runs = client.read_flow_runs()
    assert accepted.parameters["spec"]["output"]["storage_options"]["secret"] == {"env": "E31_TEST_SECRET"}
    assert planted not in json.dumps([r.parameters for r in runs], default=str)


def test_deploy_refuses_bad_schedules_before_contacting_the_server(e31, tmp_path):
    """--timezone without --cron is not ignored, bad cron strings and
    timezones do not come back as library errors, and an absolute deadline
    is not deployed on a schedule that would refuse every run after it.
    No server is needed to refuse these (none is set here)."""
    from datetime import datetime, timedelta, timezone

    env = {"PREFECT_API_URL": "http://127.0.0.1:9/api"}
    later = (datetime.now(timezone.utc) + timedelta(days=30)).replace(microsecond=0).isoformat()  # always ahead
    cases = [
        (["--timezone", "Europe/London"],
         ["--timezone applies to a --cron schedule; give --cron too (e.g. --cron '0 2 * * *')"]),
        (["--cron", "61 2 * * *", "--timezone", "Mars/Base"],
         ["--timezone 'Mars/Base' is not an IANA timezone; e.g. UTC, Europe/London, America/New_York",
          "--cron '61 2 * * *' is not a cron schedule; five fields: minute hour day-of-month month day-of-week, "
          "e.g. '0 2 * * *' (02:00 every day)"]),
        (["--cron", "0 2 * * * *"],  # Prefect takes a sixth field, seconds: a run every second of 02:00
         ["--cron '0 2 * * * *' is not a cron schedule; five fields: minute hour day-of-month month day-of-week, "
          "e.g. '0 2 * * *' (02:00 every day)"]),
        (["--cron", "", "--timezone", ""],
         ["--timezone '' is not an IANA timezone; e.g. UTC, Europe/London, America/New_York",
          "--cron '' is not a cron schedule; five fields: minute hour day-of-month month day-of-week, "
          "e.g. '0 2 * * *' (02:00 every day)"]),
        (["--cron", "0 2 * * *", "--set", "request.deadline_within=null",
          "--set", f"request.deadline={later}"],
         [f"request.deadline {later} is one moment, and every scheduled run after it would be "
          "refused; for a schedule use request.deadline_within (e.g. 4h after each scheduled start) or "
          "request.deadline_at (e.g. \"06:00 Europe/London\")"]),
    ]
    for extra, lines in cases:
        result = e31("deploy", str(EXAMPLE), "--pool", "nowhere", *extra, env=env)
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines() == [f"e31: deploy refused: {line}" for line in lines]
    result = e31("deploy", str(EXAMPLE), "--pool", "nowhere", "--cron", "0 2 * * *", env=env)
    assert result.returncode == 1
    assert result.stderr == ("e31: nothing answers at PREFECT_API_URL=http://127.0.0.1:9/api (Connection refused): is "
                             "the Prefect server running? Start it (prefect server start) or point PREFECT_API_URL at "
                             "it\n")


def test_redeploying_without_cron_says_the_schedule_was_removed(prefect_api, e31, tmp_path):
    subprocess.run([*PREFECT, "work-pool", "create", "resched-pool", "--type", "process"], check=True, capture_output=True)
    base = ["deploy", str(EXAMPLE), "--pool", "resched-pool", "--name", "resched"]
    first = e31(*base, "--cron", "0 2 * * *", "--timezone", "Europe/London")
    assert first.returncode == 0, first.stderr
    again = e31(*base)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-1].endswith(
        "on pool resched-pool, no schedule (its earlier schedule cron '0 2 * * *' in Europe/London was removed; "
        "pass --cron to keep one)")
    assert _deployment("e31-job/resched").schedules == []
