"""The manifest artifacts reach the UI when the Prefect API stops answering
at the moment they are created: the real session server is frozen
(SIGSTOP to its process group) right after the output is returned, and
thawed (SIGCONT) once E31 has said that its first try failed."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

from e31.flows.job import run_job
from e31.specs import parse_spec
from e31.flows.attempt import ON_DELIVERED
from tests.conftest import SERVER


class _ThawOnRetry(logging.Handler):
    """Thaws the frozen server when the run logs that the artifacts wait for a retry."""

    def __init__(self, thaw):
        super().__init__(logging.WARNING)
        self.thaw, self.lines = thaw, []

    def emit(self, record):
        line = record.getMessage()
        if line.startswith("manifest artifacts not created"):
            self.lines.append(line)
            self.thaw()


def test_the_manifest_artifact_is_created_when_the_api_comes_back(prefect_api, scratch, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    group = SERVER[0].pid  # the server was started in a session of its own: its group is its pid
    frozen = []

    def freeze(run_id):
        os.killpg(group, signal.SIGSTOP)
        frozen.append(run_id)

    def thaw():
        if frozen and frozen[-1] != "thawed":
            os.killpg(group, signal.SIGCONT)
            frozen.append("thawed")

    handler = _ThawOnRetry(thaw)
    logger = logging.getLogger("prefect.task_runs")
    logger.addHandler(handler)
    ON_DELIVERED.append(freeze)  # called once the output is returned, just before its artifacts
    try:
        manifest = run_job(parse_spec({
            "name": "artifact-retry",
            "work": {"kind": "processing", "command": [
                sys.executable, "-c", "import os, pathlib; pathlib.Path(os.environ['E31_OUTPUT_DIR'], 'done.txt')"
                                      ".write_text('done')"]},
            "request": {"limit": "2m"},
            "output": {"kind": "files", "url": str(tmp_path / "out"), "files": ["done.txt"]}}))
    finally:
        ON_DELIVERED.remove(freeze)
        logger.removeHandler(handler)
        os.killpg(group, signal.SIGCONT)  # whatever happened: the session's server runs on
    assert frozen == [manifest["run_id"], "thawed"]  # it was frozen for the artifacts, and thawed by the retry
    assert (manifest["status"], manifest["reason"]) == ("completed", "finished")
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[manifest["run_id"]])))
    artifacts = {a.key: a for a in found}
    assert {"manifest", "output"} <= set(artifacts)
    rows = json.loads(artifacts["manifest"].data)
    assert [(r["path"], r["status"], r["reason"]) for r in rows] == [("done.txt", "completed", "finished")]
    assert artifacts["output"].data == f"[{tmp_path / 'out'}]({(tmp_path / 'out').as_uri()})"
    assert handler.lines[0] == ("manifest artifacts not created yet (ConnectionError: the Prefect API does not "
                                "answer); trying again in 1 s (try 2 of 5)")
    assert all(" yet " in line for line in handler.lines)  # (a busy machine may need a second retry; never gave up)
