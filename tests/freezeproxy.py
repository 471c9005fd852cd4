"""A TCP relay on 127.0.0.1 in front of a real server that a test can
freeze: while frozen it accepts connections and holds every byte in both
directions, as a stopped server process (SIGSTOP) or a database holding
every connection looks to its clients; thawed, the held bytes go on.  It
notes the request line of each HTTP request it relays (``requests``)."""

from __future__ import annotations

import re
import socket
import threading

_REQUEST = re.compile(rb"^(GET|POST|PUT|PATCH|DELETE|HEAD) (\S+) HTTP/1\.[01]\r\n")


class FreezeProxy:
    """Relays 127.0.0.1:``port`` to 127.0.0.1:``upstream`` (daemon threads;
    :meth:`close` when done)."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.requests: list[str] = []  # "POST /api/flow_runs/filter", in the order relayed
        self._thawed = threading.Event()
        self._thawed.set()
        self._closed = False
        self._socks: list[socket.socket] = []
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = self._listen.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        """Hold every byte from now on."""
        self._thawed.clear()

    def thaw(self) -> None:
        """Let the held bytes go on."""
        self._thawed.set()

    def close(self) -> None:
        """Stop relaying and close every connection."""
        self._closed = True
        self._thawed.set()
        for sock in [self._listen, *self._socks]:
            try:
                sock.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listen.accept()
                server = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                return
            self._socks += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self._thawed.wait()  # frozen: held here
                if from_client and (found := _REQUEST.match(data)):
                    self.requests.append(f"{found[1].decode()} {found[2].decode()}")
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
