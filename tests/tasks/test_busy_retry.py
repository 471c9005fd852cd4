"""Quick retries of a busy Prefect API's 503 (e31.prefect_compat.busy),
against a real HTTP server on 127.0.0.1 that answers 503 a set number of
times per path before answering 200, through Prefect's own clients.

A real Prefect server answers 503 only when its SQLite database is busy,
which no test can bring about on demand; this server plays that part, and
the rest (Prefect's client, httpx, the sockets) is real."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from e31.prefect_compat.busy import DELAYS_S, busy_retries, retry_busy_quickly


class _Server:
    def __init__(self) -> None:
        self.busy: dict[str, int] = {}  # path -> 503 answers still to give
        self.body = b'{"exception_message":"Service Unavailable"}'  # Prefect's (JSONResponse has no spaces)
        self.headers: dict[str, str] = {}  # extra headers of a 503
        self.seen: list[tuple[str, str, bytes]] = []  # (method, path, body) of every request
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                owner.seen.append((self.command, self.path, body))
                left = owner.busy.get(self.path, 0)
                if left:
                    owner.busy[self.path] = left - 1
                    payload, status = owner.body, 503
                else:
                    payload, status = json.dumps({"ok": True}).encode(), 200
                self.send_response(status)
                for name, value in (owner.headers.items() if status == 503 else ()):
                    self.send_header(name, value)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_PATCH = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/api"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def server():
    from prefect.settings import PREFECT_CLIENT_CSRF_SUPPORT_ENABLED, temporary_settings

    s = _Server()
    with temporary_settings(updates={PREFECT_CLIENT_CSRF_SUPPORT_ENABLED: False}):  # it has no CSRF token route
        yield s
    s.httpd.shutdown()


def _sync_client(url: str):
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(url)


def test_a_write_answered_503_three_times_is_sent_again_at_once_with_its_body(server):
    server.busy["/api/flow_runs/abc"] = 3
    with retry_busy_quickly(_sync_client(server.url)) as client:
        response = client.request("PATCH", "/flow_runs/abc", json={"job_variables": {"e31_node": "n2"}})
        assert busy_retries(client) == (3, 1)  # all three 503s were the transport's: Prefect's 2 s retry saw none
    assert response.status_code == 200
    assert [(m, p) for m, p, _ in server.seen] == [("PATCH", "/api/flow_runs/abc")] * 4
    assert {b for _, _, b in server.seen} == {b'{"job_variables":{"e31_node":"n2"}}'}


def test_once_the_quick_retries_are_spent_prefect_s_own_retry_takes_over(server):
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    server.busy["/api/flow_runs/abc"] = len(DELAYS_S) + 2  # every quick retry of the first send, and one more
    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 1}):
        with retry_busy_quickly(_sync_client(server.url)) as client:
            started = time.monotonic()
            response = client.request("PATCH", "/flow_runs/abc", json={})
            took = time.monotonic() - started
            # the first send: 1 + len(DELAYS_S) answers 503; Prefect waits ~2 s and sends again: 503, then 200
            assert busy_retries(client) == (len(DELAYS_S) + 1, 1)
    assert response.status_code == 200
    assert len(server.seen) == len(DELAYS_S) + 3
    assert took > 1.0  # Prefect's own back-off (2 s with jitter) came between


def test_other_answers_are_returned_as_they_are(server):
    with retry_busy_quickly(_sync_client(server.url)) as client:
        assert client.request("GET", "/flow_runs/x").status_code == 200
        assert busy_retries(client) == (0, 0)
    assert len(server.seen) == 1


def test_the_async_client_of_a_worker_retries_quickly_too(server):
    from prefect.client.orchestration import PrefectClient

    server.busy["/api/flow_runs/abc/set_state"] = 2

    async def main() -> tuple[int, tuple[int, int]]:
        async with PrefectClient(server.url) as client:
            retry_busy_quickly(client)
            retry_busy_quickly(client)  # twice: still one layer
            response = await client.request("POST", "/flow_runs/abc/set_state", json={"a": "b"})
            return response.status_code, busy_retries(client)

    assert asyncio.run(main()) == (200, (2, 1))
    assert len(server.seen) == 3


def test_a_workers_labels_of_a_run_are_left_to_prefect_s_back_off(server):
    """PATCH /flow_runs/{id}/labels (nothing waits for it) is not resent
    quickly: its 503 goes to Prefect's own retry (~2 s later)."""
    from prefect.client.orchestration import PrefectClient
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    server.busy["/api/flow_runs/abc/labels"] = 1

    async def main() -> tuple[int, tuple[int, int], float]:
        async with PrefectClient(server.url) as client:
            retry_busy_quickly(client)
            started = time.monotonic()
            response = await client.request("PATCH", "/flow_runs/abc/labels", json={"a": "b"})
            return response.status_code, busy_retries(client), time.monotonic() - started

    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 1}):
        status, counted, took = asyncio.run(main())
    assert (status, counted, len(server.seen)) == (200, (0, 0), 2)  # the 503, then Prefect's own retry
    assert took > 1.0  # Prefect's back-off (2 s with jitter) came between, not a quick resend (20 ms)


@pytest.mark.parametrize("body, headers", [
    (b'{"exception_message":"Service Unavailable"}', {"Retry-After": "1"}),  # a server asking for a wait
    (b"<html>503 Service Temporarily Unavailable</html>", {}),  # a proxy's
])
def test_a_503_that_is_not_a_busy_database_goes_to_prefect_s_retries_alone(server, body, headers):
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    server.busy["/api/flow_runs/abc"], server.body, server.headers = 1, body, headers
    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 1}):
        with retry_busy_quickly(_sync_client(server.url)) as client:
            response = client.request("PATCH", "/flow_runs/abc", json={})
            assert busy_retries(client) == (0, 0)
    assert response.status_code == 200
    assert len(server.seen) == 2  # the 503, then Prefect's own retry


def test_quick_resends_are_budgeted_per_client(server, monkeypatch):
    """A server answering busy 503s to everything gets at most BUDGET quick
    resends per window from one client: the rest go to Prefect's back-off."""
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from e31.prefect_compat import busy

    monkeypatch.setattr(busy, "DELAYS_S", (0.0, 0.0, 0.0))
    monkeypatch.setattr(busy, "BUDGET", 5)
    server.busy.update({f"/api/flow_runs/r{i}": 1 for i in range(8)})
    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 1}):
        with retry_busy_quickly(_sync_client(server.url), delays=busy.DELAYS_S) as client:
            codes = [client.request("PATCH", f"/flow_runs/r{i}", json={}).status_code for i in range(8)]
            assert busy_retries(client) == (5, 5)
    assert codes == [200] * 8  # the first 5 by a quick resend, the last 3 by Prefect's retry after ~2 s
    assert len(server.seen) == 16
