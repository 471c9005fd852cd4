"""An input whose host does not answer or does not resolve is said as such
(not "not found"), naming the input and the fix, in one line."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from e31.specs import DataInput
from e31.tasks.stage import StageError, preflight, stage_task


def _closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_host_with_nothing_listening_did_not_answer():
    port = _closed_port()
    url = f"http://127.0.0.1:{port}/table.csv"
    with pytest.raises(StageError) as err:
        preflight([DataInput(name="table", url=url)])
    assert str(err.value) == (f"data 'table': {url}: the host 127.0.0.1:{port} did not answer (connection refused); "
                              "check that its server is running and the URL's host and port")


def test_a_host_name_that_does_not_resolve():
    url = "http://no-such-host.invalid/x.csv"  # .invalid: reserved, never resolves (RFC 6761)
    with pytest.raises(StageError) as err:
        preflight([DataInput(name="table", url=url)])
    assert str(err.value) == (f"data 'table': {url}: the host no-such-host.invalid does not resolve (no such name); "
                              "check the host name in the URL")


def test_a_host_gone_after_the_preflight_is_said_by_the_stage_task(tmp_path, prefect_api):
    """The server answers the listing and is gone when the copy starts: the
    stage task's retries meet a refused connection, and its last failure
    says so (masked; the signature in the URL never shows)."""
    from prefect import flow

    body = b"a,b\n1,2\n"

    class Head(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Head)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    url = f"http://127.0.0.1:{port}/t.csv?X-Amz-Signature=e31GONEsig0123456789"
    try:
        listing = preflight([DataInput(name="t", url=url)])["t"]
    finally:
        server.shutdown()
        server.server_close()  # nothing listens on the port any more
    task = stage_task.with_options(retries=1, retry_delay_seconds=[0.1])

    @flow
    def run():
        return task(DataInput(name="t", url=url), str(tmp_path / "data"), listing)

    with pytest.raises(StageError) as err:
        run()
    assert str(err.value) == (f"data 't': http://127.0.0.1:{port}/t.csv?X-Amz-Signature=***: the host "
                              f"127.0.0.1:{port} did not answer (connection refused); check that its server is "
                              "running and the URL's host and port")
    assert err.value.__cause__ is None and err.value.__context__ is None
