"""Secrets never reach the console, the flow run's logs, state messages or
manifests, including inside a client library's exception text."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.flows.test_work_output import _flow_run_logs

SIGNATURE = "e31PLANTEDsig0123456789abcdef"
CREDENTIAL = "AKIAPLANTED0123/20261130/eu/s3/aws4_request"


def test_a_presigned_url_failing_with_500_never_leaks_its_signature(e31, tmp_path, prefect_api, scratch):
    """The HTTP client's exception text
    (ClientResponseError(RequestInfo(url=URL('...X-Amz-Signature=...')))
    must not put the full signature into the console, the flow run's logs,
    the state messages or the manifest."""
    body = b"a,b\n1,2\n"
    calls = []

    class Flaky(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()

        def do_GET(self):
            calls.append(self.path)
            if len(calls) <= 2:
                self.send_response(500)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = (f"http://127.0.0.1:{server.server_address[1]}/table.csv?X-Amz-Algorithm=AWS4-HMAC-SHA256"
           f"&X-Amz-Credential={CREDENTIAL}&X-Amz-Signature={SIGNATURE}")
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps({
        "name": "presigned", "work": {"kind": "processing", "command": [
            "python", "-c", "import os, shutil; shutil.copy(os.environ['E31_DATA_TABLE'], "
                            "os.path.join(os.environ['E31_OUTPUT_DIR'], 'copy.csv'))"]},
        "data": [{"name": "table", "url": url}],
        "request": {"limit": "2m"},
        "output": {"kind": "files", "url": str(tmp_path / "out"), "files": ["copy.csv"]}}))
    try:
        result = e31("run", str(spec), env={"E31_SCRATCH": str(scratch), "PREFECT_LOGGING_LEVEL": "INFO",
                                             "E31_TRANSFER_BACKOFF_S": "0.2"})
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 0, result.stderr
    assert len(calls) >= 3  # the 500s were met and retried
    manifest_text = (tmp_path / "out" / "manifest.json").read_text()
    logs = "\n".join(_flow_run_logs(json.loads(manifest_text)["run_id"]))
    for where, text in (("console", result.stdout + result.stderr), ("flow run log", logs),
                        ("manifest", manifest_text)):
        assert SIGNATURE not in text and "AKIAPLANTED" not in text, where
    assert "X-Amz-Signature=***" in result.stdout + result.stderr + logs  # the failure was said, masked


def _prefect_db_text(needle: str) -> list[str]:
    """Every table and column of the test server's SQLite database whose
    text holds ``needle`` (read-only; the server keeps writing)."""
    import os
    import sqlite3
    from pathlib import Path

    db = Path(os.environ["PREFECT_HOME"]) / "prefect.db"
    found = []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        tables = [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            for row in conn.execute(f'SELECT * FROM "{table}"'):
                for value in row:
                    text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
                    if needle in text:
                        found.append(f"{table}: {text[:200]}")
    return found


def test_a_presigned_url_failing_for_good_leaves_no_signature_in_any_state(e31, tmp_path, prefect_api, scratch):
    """A presigned URL whose download answers HTTP 500 every time: the job
    fails after the stage task's retries.  Prefect builds the Failed states'
    messages from the exception E31 raised (which quoted the URL): the flow
    run's and task runs' states, their histories, state details and data,
    and every row of the server's database are read back and hold neither
    the signature nor the credential."""
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    signature = f"e31SIG{uuid.uuid4().hex}"  # this test's own: the database is the session's
    credential = f"AKIA{uuid.uuid4().hex[:12].upper()}/20261130/eu/s3/aws4_request"
    calls = []

    class Broken(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(200)
            self.send_header("Content-Length", "8")
            self.end_headers()

        def do_GET(self):
            calls.append(self.path)
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    url = (f"http://127.0.0.1:{port}/data.csv?X-Amz-Algorithm=AWS4-HMAC-SHA256"
           f"&X-Amz-Credential={credential}&X-Amz-Signature={signature}")
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps({
        "name": "presigned-broken", "work": {"kind": "processing", "command": ["true"]},
        "data": [{"name": "table", "url": url}],
        "request": {"limit": "2m"},
        "output": {"kind": "files", "url": str(tmp_path / "out"), "files": ["copy.csv"]}}))
    try:
        result = e31("run", str(spec), env={"E31_SCRATCH": str(scratch), "E31_TRANSFER_RETRIES": "1",
                                             "E31_TRANSFER_BACKOFF_S": "0.1"})
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 1, result.stderr
    assert len(calls) == 2  # the first try and its retry
    shown = (f"data 'table': http://127.0.0.1:{port}/data.csv?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
             f"&X-Amz-Signature=***: cannot copy it (ClientResponseError: 500, message='Internal Server Error', "
             f"url='http://127.0.0.1:{port}/data.csv?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
             f"&X-Amz-Signature=***')")
    assert f"e31: {shown}" in result.stderr.splitlines()
    manifest = json.loads((tmp_path / "out" / "partial" / "manifest.json").read_text())
    assert (manifest["status"], manifest["message"]) == ("failed", shown)
    run_id = manifest["run_id"]
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        records = [run, *client.read_flow_run_states(run_id)]
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        for task_run in tasks:
            records += [task_run, *client.read_task_run_states(task_run.id)]
    assert (run.state.type.value, run.state.message) == ("FAILED", shown)
    stage = [t for t in tasks if t.name == "stage-table"]
    assert len(stage) == 1 and stage[0].state.type.value == "FAILED"
    assert stage[0].state.message == f"Task run encountered an exception CopyFailed: {shown}"
    for record in records:  # every state with its details and data, as the API has them
        text = record.model_dump_json()
        assert signature not in text and credential.split("/")[0] not in text, text
    assert _prefect_db_text(signature) == [] and _prefect_db_text(credential) == []
