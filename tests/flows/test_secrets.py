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
    """Found by trying public bug reports: the HTTP client's exception text
    (ClientResponseError(RequestInfo(url=URL('...X-Amz-Signature=...')))
    put the full signature into the console, the flow run's logs, the
    state messages and the manifest."""
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
