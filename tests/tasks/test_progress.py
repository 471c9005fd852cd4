"""Progress lines logged from the work's reports (tasks/progress.py)."""

from __future__ import annotations

import json
import logging
import os

from e31.tasks.supervisor import progress


def test_the_final_report_is_logged_once(tmp_path, monkeypatch, caplog):
    """Found by a fresh-user trial: the last progress line appeared twice
    (once when seen, again at the final poll)."""
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
