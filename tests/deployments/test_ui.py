"""The flow run of a job in the real Prefect UI, opened in headless Chromium
(Debian's chromium package; .ci/run installs it)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from e31.flows.deploy import job_tags
from e31.flows.job import run_job
from e31.specs import load_spec
from tests.conftest import REPO, prefect_ui_url

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1500,1100", "--virtual-time-budget=20000"]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium; .ci/run installs it)")
def test_flow_run_page_shows_the_job_in_headless_chromium(prefect_api, scratch, tmp_path):
    from prefect import tags

    spec = load_spec(REPO / "specs/examples/digits-nightly-retrain.yaml",
                     overrides=[f"output.url={tmp_path / 'out'}", "work.params.epochs=4", "work.params.epoch_sleep=0.5"])
    with tags(*job_tags(spec)):
        state = run_job(spec, return_state=True)
    page = f"{prefect_ui_url()}/runs/flow-run/{state.state_details.flow_run_id}"
    shot = tmp_path / "flow-run.png"
    subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile-1'}", f"--screenshot={shot}", page],
                   check=True, capture_output=True, timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 30_000  # a rendered page, not blank
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile-2'}", "--dump-dom", page],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    for text in ("digits-nightly-retrain", "kind:training", "gpus:0", "Completed"):
        assert text in dom, text


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium; .ci/run installs it)")
def test_a_deployments_custom_run_form_renders_the_spec_schema(prefect_api, e31, tmp_path):
    """The run form of an e31 deployment is built from the spec's JSON Schema
    (with the credential patterns of storage_options): the page renders it."""
    import sys

    subprocess.run([sys.executable, "-m", "prefect", "work-pool", "create", "ui-pool", "--type", "process"],
                   check=True, capture_output=True)
    result = e31("deploy", str(REPO / "specs/examples/digits-nightly-retrain.yaml"), "--pool", "ui-pool",
                 "--name", "ui-form")
    assert result.returncode == 0, result.stderr
    deployment_id = result.stdout.splitlines()[-1].split("(")[1].split(")")[0]
    page = f"{prefect_ui_url()}/deployments/deployment/{deployment_id}/run"
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    for text in ("ui-form", "Spec", "Output", "Storage Options"):
        assert text in dom, text


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium; .ci/run installs it)")
def test_a_queued_run_shows_why_it_waits_in_the_ui(prefect_api, tmp_path):
    """The live queue's reason is the waiting flow run's state message: the
    Prefect UI shows it on the run's page."""
    import os

    from prefect.client.orchestration import get_client

    from tests.deployments.test_queue import queue, wait_for

    with queue(tmp_path, {"n1": 8}) as q:
        q.scheduler()
        q.worker("n1", 8)
        q.submit(q.job("holder", 8, 40))
        wait_for(lambda: any((q.root / "scratch-n1").glob("holder/output/started.json")), what="the holder")
        waiting = q.submit(q.job("waiter", 6, 1)).split("flow run ")[1].split()[0]
        with get_client(sync_client=True) as client:
            wait_for(lambda: (client.read_flow_run(waiting).state.message or "").startswith("Queued: waiting for 6 GPUs"),
                     what="the reason")
        page = f"{prefect_ui_url()}/runs/flow-run/{waiting}"
        shot = tmp_path / "queued-run.png"
        subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile-1'}", f"--screenshot={shot}", page],
                       check=True, capture_output=True, timeout=120)
        dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile-2'}", "--dump-dom", page],
                             check=True, capture_output=True, text=True, timeout=120).stdout
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 30_000
    for text in ("waiter", "Queued", "waiting for 6 GPUs on one node (0 free on n1)"):
        assert text in dom, text
    if os.environ.get("E31_UI_SHOTS"):  # refresh the pictures in docs/: E31_UI_SHOTS=docs pytest -k queued_run
        shutil.copy(shot, REPO / os.environ["E31_UI_SHOTS"] / "ui-queued-run.png")
