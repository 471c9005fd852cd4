"""What E31 hands to Prefect as a failure (tasks/storage/masked_errors.py):
masked text, nothing chained that holds a credential.  The exceptions are
real: an HTTP client's error from a real local server answering 500."""

from __future__ import annotations

import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from e31.errors import E31Error
from e31.tasks.stage import StageError
from e31.tasks.storage.masked_errors import MaskedError, masked_exception, masks_failures

SIGNATURE = "e31MASKsig0123456789abcdef"


@pytest.fixture
def broken_url():
    """A presigned-looking URL on a real local server that answers every request with HTTP 500."""

    class Broken(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/d.csv?X-Amz-Signature={SIGNATURE}"
    finally:
        server.shutdown()
        server.server_close()


def _client_error(url: str) -> Exception:
    import fsspec

    try:
        fsspec.filesystem("http", skip_instance_cache=True).cat_file(url)
    except Exception as exc:
        return exc
    raise AssertionError("the server answered")


def test_a_client_error_quoting_a_signed_url_leaves_as_a_masked_stand_in(broken_url):
    original = _client_error(broken_url)
    assert SIGNATURE in str(original)  # what Prefect would have put in the state's message
    failure = masked_exception(original)
    masked_url = broken_url.replace(SIGNATURE, "***")
    assert type(failure) is MaskedError and isinstance(failure, E31Error)
    assert str(failure) == f"ClientResponseError: 500, message='Internal Server Error', url='{masked_url}'"
    assert failure.original == "aiohttp.client_exceptions.ClientResponseError"
    assert (failure.__cause__, failure.__context__) == (None, None)
    again = pickle.loads(pickle.dumps(failure))  # as Prefect persists a failed state's exception
    assert (type(again), str(again), again.original) == (MaskedError, str(failure), failure.original)


def test_an_e31_error_keeps_its_type_and_loses_a_leaky_chain(broken_url):
    def stage():
        try:
            raise _client_error(broken_url)
        except Exception:
            raise StageError(f"data 'd': {broken_url}: broken") from None  # context still holds the client's error

    with pytest.raises(StageError) as err:
        stage()
    assert SIGNATURE in str(err.value.__context__)
    failure = masked_exception(err.value)
    assert failure is err.value  # the same object: callers and retry conditions still know it
    assert str(failure) == f"data 'd': {broken_url.replace(SIGNATURE, '***')}: broken"
    assert (failure.__cause__, failure.__context__) == (None, None)


def test_a_clean_exception_is_left_as_it_is():
    try:
        try:
            raise KeyError("plain")
        except KeyError as inner:
            raise ValueError("no secret here") from inner
    except ValueError as exc:
        clean = exc
    assert masked_exception(clean) is clean and isinstance(clean.__cause__, KeyError)


def test_the_decorator_raises_the_masked_exception_with_nothing_chained(broken_url):
    @masks_failures
    def fetch():
        try:
            raise _client_error(broken_url)
        except Exception as exc:
            raise RuntimeError(f"wrapped: {exc}") from exc

    with pytest.raises(RuntimeError) as err:
        fetch()
    assert SIGNATURE not in str(err.value) and str(err.value).startswith("wrapped: 500, message=")
    assert (err.value.__cause__, err.value.__context__) == (None, None)

    @masks_failures
    def interrupted():
        raise KeyboardInterrupt(broken_url)  # not an Exception: passes untouched

    with pytest.raises(KeyboardInterrupt) as stop:
        interrupted()
    assert str(stop.value) == broken_url
