"""Counts the Prefect API calls of a process (benchmark instrumentation, not
part of E31): put this folder on ``PYTHONPATH`` and set
``E31_BENCH_API_CALLS=PREFIX``; at exit the process writes
``PREFIX.<pid>.json`` with its HTTP requests by method and route (flow run
and task run ids replaced by ``{id}``) and the events it sent over the
events websocket, by event name (with ``E31_BENCH_API_WHERE=1``, each
request also by the innermost E31 line that made it, or ``prefect``), and the SSL contexts it created (``ssl.create_default_context``: each
parses certifi's bundle, ~30 ms of CPU) with their CPU milliseconds.  Used by ``bench_vs_prefect.py --count-api``."""

from __future__ import annotations

import atexit
import collections
import json
import os
import re
import sys

_PREFIX = os.environ.get("E31_BENCH_API_CALLS")

if _PREFIX:
    _counts: collections.Counter = collections.Counter()
    _ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

    _WHERE = os.environ.get("E31_BENCH_API_WHERE")  # also count each call by the E31 line that made it

    def _caller() -> str:
        frame = sys._getframe(3)
        while frame is not None:
            name = frame.f_code.co_filename
            if "/site-packages/" not in name and "/lib/python3" not in name and "apicount" not in name:
                return f"{os.path.basename(name)}:{frame.f_lineno} {frame.f_code.co_name}"
            frame = frame.f_back
        return "prefect"

    def _key(request) -> str:
        key = f"{request.method} {_ID.sub('{id}', request.url.path)}"
        if _WHERE:
            _counts[f"{key} @ {_caller()}"] += 1
        return key

    import httpx

    _sync, _async = httpx.HTTPTransport.handle_request, httpx.AsyncHTTPTransport.handle_async_request

    def _handle(self, request):
        _counts[_key(request)] += 1
        return _sync(self, request)

    async def _handle_async(self, request):
        _counts[_key(request)] += 1
        return await _async(self, request)

    httpx.HTTPTransport.handle_request = _handle
    httpx.AsyncHTTPTransport.handle_async_request = _handle_async

    try:
        from websockets.asyncio.client import ClientConnection

        _send = ClientConnection.send

        async def _ws_send(self, message, *args, **kwargs):
            try:
                name = json.loads(message).get("event")
            except Exception:
                name = None
            _counts[f"event {name}" if name else "websocket message"] += 1
            return await _send(self, message, *args, **kwargs)

        ClientConnection.send = _ws_send
    except ImportError:
        pass

    import ssl
    import time

    _ssl = ssl.create_default_context

    def _context(*args, **kwargs):  # each costs ~30 ms of CPU (certifi's bundle parsed): counted, with its CPU
        started = time.process_time()
        try:
            return _ssl(*args, **kwargs)
        finally:
            _counts["ssl.create_default_context"] += 1
            _counts["ssl.create_default_context CPU ms"] += round((time.process_time() - started) * 1000)

    ssl.create_default_context = _context

    def _dump() -> None:
        if _counts:
            with open(f"{_PREFIX}.{os.getpid()}.json", "w") as fh:
                json.dump({"argv": sys.argv[:3], "counts": dict(_counts)}, fh)

    atexit.register(_dump)
