"""Progress lines logged from the work's reports (tasks/progress.py)."""

from __future__ import annotations

import json
import logging
import os

from e31.tasks.supervisor import progress


def test_the_final_report_is_logged_once(tmp_path, monkeypatch, caplog):
    """The last progress line is logged once, not twice (once when seen,
    again at the final poll)."""
    logger = logging.getLogger("e31-test-progress")
    monkeypatch.setattr(progress, "get_run_logger", lambda: logger)
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: False, raising=False)
    path = tmp_path / "progress.json"
    reporter = progress.ProgressReporter("job", path)
    with caplog.at_level(logging.INFO, logger=logger.name):
        path.write_text(json.dumps({"done": 5, "total": 5, "metrics": {"loss": 0.05538}}))
        reporter.poll()
        reporter.poll(final=True)
        path.write_text(json.dumps({"done": 6, "total": 6, "metrics": {}}))
        os.utime(path, ns=(1, 1))
        reporter.poll(final=True)
    assert [r.getMessage() for r in caplog.records] == ["progress 5/5 loss=0.05538", "progress 6/6"]


def test_a_transfer_longer_than_a_report_interval_shows_its_progress_artifact(prefect_api):
    """A transfer's progress artifact is created at its first report (2 s
    in) and ends at 100%; a transfer done sooner makes none (the task's log
    line and the manifest say what moved: the API calls would buy nothing)."""
    import time

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from e31.tasks.storage.progress import ARTIFACT_EVERY_S, TransferProgress

    @flow(name="e31-test-transfer-progress")
    def transfers() -> str:
        from prefect.runtime import flow_run

        with TransferProgress("slow-copy", 1000, 2) as slow:
            slow.advance(400)
            time.sleep(ARTIFACT_EVERY_S + 0.5)
            slow.advance(600)
        with TransferProgress("quick-copy", 1000, 1) as quick:
            quick.advance(1000)
        return flow_run.id

    run_id = transfers()
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[run_id])))
    assert [(a.key, a.type, a.data) for a in found] == [("slow-copy", "progress", 100.0)]
    assert found[0].description.startswith("slow-copy: 1000 B of 1000 B (100%), 2 file(s)")
