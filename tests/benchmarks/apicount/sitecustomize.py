"""Counts the Prefect API calls of a process (benchmark instrumentation, not
part of E31): put this folder on ``PYTHONPATH`` and set
``E31_BENCH_API_CALLS=PREFIX``; at exit the process writes
``PREFIX.<pid>.json`` with its HTTP requests by method and route (flow run
and task run ids replaced by ``{id}``) and the events it sent over the
events websocket, by event name (with ``E31_BENCH_API_WHERE=1``, each
request also by the innermost E31 line that made it, or ``prefect``), and the SSL contexts it created (``ssl.create_default_context``: each
parses certifi's bundle, ~30 ms of CPU) with their CPU milliseconds.  With
``E31_BENCH_API_TRACE=1`` it also keeps each request's wall-clock start
(epoch seconds), its duration (seconds), its route and the E31 line that
made it, in order (``"trace"``), and the process's flow run id
(``PREFECT__FLOW_RUN_ID``), to lay a run's calls on its timeline.  Used by
``bench_vs_prefect.py --count-api`` and ``bench_queue.py --count-api``."""

from __future__ import annotations

import atexit
import collections
import json
import os
import re
import sys
import time

# Not in a job's work (its processes have E31_WORK_TOKEN): its own start is part of what is measured.
_PREFIX = None if os.environ.get("E31_WORK_TOKEN") else os.environ.get("E31_BENCH_API_CALLS")

if _PREFIX:
    _counts: collections.Counter = collections.Counter()
    _ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

    _WHERE = os.environ.get("E31_BENCH_API_WHERE")  # also count each call by the E31 line that made it
    _TRACE = os.environ.get("E31_BENCH_API_TRACE")  # also keep each call's start, duration and caller
    _trace: list = []

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
        key = _key(request)
        _counts[key] += 1
        if not _TRACE:
            return _sync(self, request)
        started, where = time.time(), _caller()
        try:
            return _sync(self, request)
        finally:
            _trace.append((round(started, 4), round(time.time() - started, 4), key, where))

    async def _handle_async(self, request):
        key = _key(request)
        _counts[key] += 1
        if not _TRACE:
            return await _async(self, request)
        started, where = time.time(), _caller()
        try:
            return await _async(self, request)
        finally:
            _trace.append((round(started, 4), round(time.time() - started, 4), key, where))

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
            if _TRACE:
                _trace.append((round(time.time(), 4), 0.0, f"event {name}", _caller()))
            return await _send(self, message, *args, **kwargs)

        ClientConnection.send = _ws_send
    except ImportError:
        pass

    import ssl

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
                json.dump({"argv": sys.argv[:3], "counts": dict(_counts), "trace": _trace,
                           "flow_run_id": os.environ.get("PREFECT__FLOW_RUN_ID")}, fh)

    atexit.register(_dump)

    def _forked() -> None:  # a forked child (a warm process's flow process) counts its own calls, not its parent's
        _counts.clear()
        _trace.clear()

    os.register_at_fork(after_in_child=_forked)

    # With E31_BENCH_API_TRACE, also the start and duration of each call of a few E31 functions (module:function,
    # comma-separated in E31_BENCH_TRACE_MARKS): wrapped as their module is first imported, before any other
    # module binds them by name.
    _MARKS: dict[str, list[str]] = {}
    for _mark in (os.environ.get("E31_BENCH_TRACE_MARKS") or "").split(",") if _TRACE else ():
        if ":" in _mark:
            _MARKS.setdefault(_mark.split(":")[0], []).append(_mark.split(":")[1])
    if _MARKS:
        import functools
        import importlib.abc
        import importlib.machinery

        def _wrap(module, name):
            original = getattr(module, name)

            @functools.wraps(original)
            def marked(*args, **kwargs):
                started = time.time()
                try:
                    return original(*args, **kwargs)
                finally:
                    _trace.append((round(started, 4), round(time.time() - started, 4), f"mark {name}", module.__name__))
            setattr(module, name, marked)

        class _Marker(importlib.abc.MetaPathFinder):
            def find_spec(self, fullname, path, target=None):
                if fullname not in _MARKS:
                    return None
                spec = importlib.machinery.PathFinder.find_spec(fullname, path)
                if spec is None or spec.loader is None:
                    return spec
                execute = spec.loader.exec_module

                def exec_module(module):
                    execute(module)
                    for name in _MARKS[fullname]:
                        _wrap(module, name)
                spec.loader.exec_module = exec_module
                return spec

        sys.meta_path.insert(0, _Marker())
