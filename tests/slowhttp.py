"""A local HTTP server that serves one 30 x 64 KiB file at 64 KiB a second: a download slow enough
for a test to act while a run stages its inputs (a cancel, a preemption)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: Chunks of 64 KiB in the file (it is 1.875 MiB).
CHUNKS = 30


def slow_server(slow_gets: int | None = None) -> tuple[ThreadingHTTPServer, list[float]]:
    """Start the server on 127.0.0.1 (a daemon thread; call ``shutdown()`` when done).  Returns it and
    the list of the times each GET came.  ``slow_gets``: how many GETs, the first ones, are served at
    64 KiB/s (None: all of them); later ones at full speed.  A client that goes away ends its GET."""
    gets: list[float] = []

    class Slow(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_HEAD(self):
            self.send_response(200)
            self.send_header("Content-Length", str(CHUNKS * 65536))
            self.end_headers()

        def do_GET(self):
            gets.append(time.time())
            slow = slow_gets is None or len(gets) <= slow_gets
            self.do_HEAD()
            try:
                for _ in range(CHUNKS):
                    self.wfile.write(b"x" * 65536)
                    self.wfile.flush()
                    if slow:
                        time.sleep(1)
            except OSError:
                pass  # the client went away: the stop

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, gets
