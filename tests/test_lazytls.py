"""e31.prefect_compat.lazytls: client TLS contexts whose trust store is read at their first
connection.  Real TLS connections to a local HTTPS server with a
self-signed certificate (made with the ``openssl`` command), through
``ssl`` sockets, ``httpx`` and ``asyncio``."""

from __future__ import annotations

import asyncio
import http.server
import ssl
import subprocess
import threading

import certifi
import httpx
import pytest

from e31.prefect_compat.lazytls import _STDLIB, LazyTrustContext, create_default_context, install


@pytest.fixture(scope="module")
def https(tmp_path_factory):
    """(URL, CA file) of an HTTPS server on 127.0.0.1 answering ``ok`` with a
    certificate signed by nobody but itself."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    side.load_cert_chain(cert, key)
    server.socket = side.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}/", cert
    server.shutdown()


def test_a_client_context_is_set_up_as_the_standard_library_s_and_trusts_the_same_certificates():
    lazy, plain = create_default_context(cafile=certifi.where()), _STDLIB(cafile=certifi.where())
    assert isinstance(lazy, LazyTrustContext)
    assert (lazy.protocol, lazy.verify_mode, lazy.check_hostname, lazy.options, lazy.minimum_version) == (
        plain.protocol, plain.verify_mode, plain.check_hostname, plain.options, plain.minimum_version)
    assert lazy.cert_store_stats() == plain.cert_store_stats()  # read at this first look
    assert lazy.cert_store_stats()["x509_ca"] > 100
    assert sorted(c["serialNumber"] for c in lazy.get_ca_certs()) == sorted(c["serialNumber"]
                                                                           for c in plain.get_ca_certs())
    # no file: the system's default certificates, as the standard library
    assert create_default_context().cert_store_stats() == _STDLIB().cert_store_stats()


def test_its_trust_store_is_read_at_the_first_connection_not_at_creation(https, tmp_path):
    url, cert = https
    missing = create_default_context(cafile=str(tmp_path / "gone.pem"))  # the standard library raises here
    gone = f"cannot read the trusted certificates {tmp_path / 'gone.pem'}: No such file or directory"
    with pytest.raises(httpx.ConnectError) as info:
        httpx.get(url, verify=missing)
    assert str(info.value) == f"[Errno 2] {gone}"
    with pytest.raises(FileNotFoundError, match=f"^\\[Errno 2\\] {gone}$"):  # again at the next connection
        missing.get_ca_certs()
    trusted = create_default_context(cafile=str(cert))
    assert "_e31_trust" in trusted.__dict__  # nothing read yet
    assert httpx.get(url, verify=trusted).text == "ok"
    assert "_e31_trust" not in trusted.__dict__


def test_it_verifies_certificates_as_before_through_sockets_httpx_and_asyncio(https):
    url, cert = https
    port = int(url.rsplit(":", 1)[1].strip("/"))
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(url, verify=create_default_context(cafile=certifi.where()))  # not signed by a public CA
    with pytest.raises(ssl.SSLCertVerificationError):
        import socket

        with socket.create_connection(("127.0.0.1", port)) as raw:
            create_default_context().wrap_socket(raw, server_hostname="127.0.0.1")
    assert httpx.get(url, verify=create_default_context(cafile=str(cert))).text == "ok"

    async def fetch() -> str:
        async with httpx.AsyncClient(verify=create_default_context(cafile=str(cert))) as client:
            return (await client.get(url)).text

    assert asyncio.run(fetch()) == "ok"

    async def handshake(context) -> bytes:  # asyncio's own TLS (SSLObject through wrap_bio)
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        answer = await reader.read()
        writer.close()
        return answer

    assert asyncio.run(handshake(create_default_context(cafile=str(cert)))).endswith(b"ok")
    with pytest.raises(ssl.SSLCertVerificationError):
        asyncio.run(handshake(create_default_context(cafile=certifi.where())))


def test_a_context_s_own_changes_stay_its_own_and_install_can_be_turned_off(monkeypatch):
    a, b = create_default_context(cafile=certifi.where()), create_default_context(cafile=certifi.where())
    a.check_hostname, a.verify_mode = False, ssl.CERT_NONE  # Prefect's PREFECT_API_TLS_INSECURE_SKIP_VERIFY
    assert (b.check_hostname, b.verify_mode) == (True, ssl.CERT_REQUIRED)
    # a context without a file, first used unverified, must keep the system's certificates (they were lost for good)
    c = create_default_context()
    c.check_hostname, c.verify_mode = False, ssl.CERT_NONE
    c.get_ca_certs()
    c.verify_mode, c.check_hostname = ssl.CERT_REQUIRED, True
    assert c.cert_store_stats() == _STDLIB().cert_store_stats()
    server = create_default_context(ssl.Purpose.CLIENT_AUTH)  # a server's context: the standard library's
    assert type(server) is ssl.SSLContext
    with pytest.raises(TypeError):
        create_default_context("not a purpose")
    original = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", original)
    monkeypatch.setenv("E31_LAZY_TLS", "0")
    assert install() is False and ssl.create_default_context is original
    monkeypatch.setenv("E31_LAZY_TLS", "1")
    assert install() is True and ssl.create_default_context is create_default_context
