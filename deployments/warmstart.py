"""Warm flow processes for ``e31 worker``: Prefect and E31 imported once,
forked per flow run.

A cold flow process spends 1.3 s of CPU (idle machine) to 3 s of wall time
(busy 2-core machine) importing Prefect and E31 before the run's first API
call.  ``e31 worker`` instead starts this module once:

    python -m e31.deployments.warmstart SOCKET [WORK_POOL]

It imports ``prefect.engine``, ``prefect.flow_engine`` and ``e31.flows.job``,
and what a run imports later (:data:`PRELOAD_OPTIONAL`; no torch, no CUDA:
the work's own process imports those with its placed
``CUDA_VISIBLE_DEVICES``), checks that it is a single thread (a fork copies
only the calling thread, so a forked copy of a threaded process can
deadlock), and serves the Unix socket ``SOCKET`` (mode 0600).  Each flow
run's command is :mod:`e31.deployments.warmstart_client`, which hands over the
run's environment, working folder and standard streams; this process forks,
and the child takes them (its standard input; its output goes straight to
the worker's own, see :func:`become_flow_process`) and runs
``prefect.engine`` as ``__main__``, exactly what ``python -m prefect.engine``
runs.

With ``WORK_POOL`` (an E31 pool's work pool), it also reads once what
every run of that pool's queue deployment reads at its start
(:func:`e31.deployments.warmprep.prefill`), so its forks need not.  Before forking it builds the
pydantic models Prefect builds at their first use (:func:`~e31.deployments.warmprep.build_models`)
and freezes its objects out of the garbage collector (``gc.freeze``): a
fork's first collection otherwise walked, and so copied, most of the
memory it shares with this process.  Together: 0.72 CPU-s of user time per
flow process before, 0.20 s after (bench_queue, 3 s jobs).

Rules that keep a forked run the same as a cold one:

- The child gets the run's whole environment.  Prefect's settings are read
  at import, so a run whose ``PREFECT_*`` settings differ from this
  process's is answered ``cold`` and starts as a fresh process.
- If this process has more than one thread when a run comes, the run is
  answered ``cold``.
- This process is its own session (the worker starts it with
  ``start_new_session``): a Ctrl-C at the worker's terminal reaches the
  client, which forwards it once to its child.
- It ends when its standard input closes (the worker ended or died), after
  its last child is reaped: the runs it started finish, and their clients
  get their exit status.

Linux and macOS only (``fork``, ``SCM_RIGHTS``).
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import subprocess

#: The Unix socket of this process's warm flow process, while its worker runs (one worker per process).
WARM_SOCKET: list[str] = []
#: Prefect settings each flow process of an ``e31 worker`` (and its warm process) gets unless set otherwise: its
#: worker checked the server's API version at its own start, so each flow process need not (Prefect's setting
#: for worker subprocesses; it saves 2 requests per flow process, its API client's and its events client's).
FLOW_PROCESS_SETTINGS = {"PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED": "false"}
#: The modules imported before any fork.
PRELOAD = ("prefect.engine", "prefect.flow_engine", "e31.flows.job")
#: Imported too when they can be: what a run of ``run_job`` imports later (measured with Prefect 3.9.1:
#: its task engine, anyio's asyncio backend, fastapi and graphviz through Prefect; s3fs for object-store
#: data, ~0.4 s), none of which starts a thread at import.
PRELOAD_OPTIONAL = ("prefect.task_engine", "prefect.concurrency.sync", "anyio._backends._asyncio", "fastapi",
                    "graphviz", "s3fs")


def flow_process_command() -> str:
    """The command of a flow process: the warm start's client when this
    process's worker keeps a warm process, else ``python -m prefect.engine``."""
    import shlex
    from pathlib import Path

    if WARM_SOCKET:
        client = Path(__file__).with_name("warmstart_client.py")
        return shlex.join([sys.executable, "-S", str(client), WARM_SOCKET[0]])
    return shlex.join([sys.executable, "-m", "prefect.engine"])


def start_warm_process(work_pool: str | None = None) -> subprocess.Popen:
    """Start ``python -m e31.deployments.warmstart SOCKET [WORK_POOL]`` in its
    own session, with the environment a flow process gets (this process's,
    plus Prefect's current settings and :data:`FLOW_PROCESS_SETTINGS`), and
    point :func:`flow_process_command` at it.  Runs that come before it
    listens start cold."""
    import subprocess
    import tempfile
    from pathlib import Path

    from prefect.settings import get_current_settings

    env = {**FLOW_PROCESS_SETTINGS, **os.environ, **get_current_settings().to_environment_variables(exclude_unset=True)}
    socket_path = str(Path(tempfile.mkdtemp(prefix="e31-warm-")) / "socket")
    proc = subprocess.Popen([sys.executable, "-m", "e31.deployments.warmstart", socket_path,
                             *([work_pool] if work_pool else [])], env=env,
                            stdin=subprocess.PIPE, start_new_session=True)
    WARM_SOCKET[:] = [socket_path]
    return proc


def settings_env(env: dict[str, str]) -> dict[str, str]:
    """What in ``env`` took effect at interpreter start or import: Prefect's
    ``PREFECT_*`` settings (not its ``PREFECT__*`` per-run variables, which
    the engine reads when it runs) and Python's ``PYTHON*`` variables
    (``PYTHONPATH``, ...)."""
    return {k: v for k, v in env.items() if (k.startswith("PREFECT_") and not k.startswith("PREFECT__"))
            or k.startswith("PYTHON")}


def threads() -> int:
    """Threads of this process (all of them on Linux, not only Python's)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


#: Bytes a request may have (an environment is a few KiB).
MAX_REQUEST = 1 << 20


def _recv_request(conn: socket.socket, fds: list[int]) -> dict[str, Any]:
    """One request: ``{"env": {...}, "cwd": "..."}``, its fds appended to
    ``fds`` (three: 0, 1, 2).  Raises ``ValueError`` or ``OSError``."""
    data, got, _flags, _addr = socket.recv_fds(conn, 4, 3)
    fds.extend(got)
    while len(data) < 4:
        more = conn.recv(4 - len(data))
        if not more:
            raise ConnectionError("client closed before its request")
        data += more
    (size,) = struct.unpack("!I", data)
    if size > MAX_REQUEST:
        raise ValueError(f"request of {size} bytes")
    body = b""
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ConnectionError("client closed during its request")
        body += more
    if len(fds) != 3:
        raise ValueError(f"expected 3 file descriptors, got {len(fds)}")
    request = json.loads(body)
    if not (isinstance(request, dict) and isinstance(request.get("env"), dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in request["env"].items())
            and isinstance(request.get("cwd", ""), str)):
        raise ValueError("not a request: {\"env\": {name: value}, \"cwd\": path}")
    return request


class Server:
    """The warm process's loop: accept a run, fork it, reap it, report its end."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.env = dict(os.environ)
        self.children: dict[int, socket.socket] = {}
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:  # bound and listening under another name, then renamed: the socket's path exists once it listens
            self.listener.bind(path + ".new")
        finally:
            os.umask(old)
        self.listener.listen(64)
        os.rename(path + ".new", path)
        self.open = True

    def serve(self) -> tuple[dict[str, Any], list[int], socket.socket] | None:
        """Serve until stdin closes and the last child is reaped (returns
        None), or return in a forked child with its request, fds and
        connection."""
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, "accept")
        sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
        while self.open or self.children:
            for key, _ in sel.select(timeout=0.2):
                if key.data == "stdin":
                    if not os.read(sys.stdin.fileno(), 4096):  # the worker ended: accept no more runs
                        sel.unregister(key.fd)
                        sel.unregister(self.listener)
                        self.listener.close()
                        self._close()
                elif key.data == "accept" and self.open:
                    child = self._accept()
                    if child is not None:
                        sel.close()
                        return child
            self._reap()
        return None

    def _close(self) -> None:
        """Accept no more runs: the socket goes, and the worker's ``e31-warm-*`` folder of it."""
        self.open = False
        try:
            os.unlink(self.path)
            if os.path.basename(os.path.dirname(self.path)).startswith("e31-warm-"):
                os.rmdir(os.path.dirname(self.path))
        except OSError:
            pass

    def _accept(self) -> tuple[dict[str, Any], list[int], socket.socket] | None:
        conn, _ = self.listener.accept()
        fds: list[int] = []
        try:
            conn.settimeout(2)  # a client sends at once; a stalled one holds the others back at most this long
            request = _recv_request(conn, fds)
        except Exception as exc:  # noqa: BLE001 - a bad request ends that request only
            print(f"e31 warm: a flow-process request failed ({type(exc).__name__}: {str(exc)[:200]}); its client "
                  "starts the run cold", file=sys.stderr, flush=True)
            conn.close()
            for fd in fds:
                os.close(fd)
            return None
        env = request["env"]
        if settings_env(env) != settings_env(self.env) or threads() > 1:
            conn.sendall(b"cold\n")
            conn.close()
            for fd in fds:
                os.close(fd)
            return None
        # Everything this process holds now is left out of every collection in the child (and here): a
        # collection walks every object it tracks, writing to each, so the first one in a fork copied most of
        # Prefect's memory into it (~0.5 CPU-s per flow process).  Python's gc docs advise gc.freeze() before
        # a fork for this reason.  Objects made here since the last call (one request's) join them.
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            self.listener.close()
            for c in self.children.values():
                c.close()
            return request, fds, conn
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        return None

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            if os.WIFSIGNALED(status):
                line = f"signal {os.WTERMSIG(status)}\n"
            else:
                line = f"exit {os.waitstatus_to_exitcode(status)}\n"
            try:
                conn.sendall(line.encode())
            except OSError:
                pass  # the client is gone; nobody waits for this status
            conn.close()


def _watch_client(conn: socket.socket) -> None:
    """In the child: SIGKILL this process when the client's end closes (the
    worker killed the flow process it knows)."""
    try:
        while conn.recv(4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def become_flow_process(request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
    """In the forked child: take the run's standard input, folder and
    environment, then run ``prefect.engine`` as ``__main__`` (raises what
    it raises; ``SystemExit`` carries its exit status).

    Its standard output and error stay this process's: the worker's own
    (``e31 worker`` starts the warm process with its streams), not the
    pipes the client got from Prefect's process worker.  Prefect's worker
    reads those pipes and copies each line to its own output, so the lines
    land in the same place; but once the worker is killed (kill -9) a pipe
    has no reader, and the run's next log line raised ``BrokenPipeError``,
    which Prefect's console handler (rich) turns into ``SystemExit(1)``:
    the run crashed with no manifest, where it should finish and return
    its output (a worker started again finds it still running)."""
    import runpy
    import warnings

    os.dup2(fds[0], 0)
    for fd in fds:
        os.close(fd)
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGPIPE else signal.SIG_IGN)
    os.chdir(request.get("cwd") or "/")
    os.environ.clear()
    os.environ.update(request["env"])
    conn.settimeout(None)
    conn.sendall(f"pid {os.getpid()}\n".encode())
    threading.Thread(target=_watch_client, args=(conn,), name="e31-warm-client", daemon=True).start()
    import prefect.engine

    sys.argv = [prefect.engine.__file__]
    # what ``python -m prefect.engine`` runs; the module was imported before the fork, which runpy warns of
    warnings.filterwarnings("ignore", message="'prefect.engine' found in sys.modules", category=RuntimeWarning)
    runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m e31.deployments.warmstart SOCKET [WORK_POOL]``."""
    import importlib

    from e31.prefect_compat.lazytls import install

    args = argv if argv is not None else sys.argv[1:]
    path = args[0]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker stops this process by closing stdin
    install()  # its runs' Prefect clients load no trust store until they make a TLS connection (e31.prefect_compat.lazytls)
    for name in PRELOAD:
        importlib.import_module(name)
    for name in PRELOAD_OPTIONAL:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    from prefect.flow_engine import _load_flow_from_runtime_entrypoint

    from e31.flows.deploy import ENTRYPOINT

    _load_flow_from_runtime_entrypoint(ENTRYPOINT)
    from e31.prefect_compat.runlog import drop_explained_failures

    drop_explained_failures()  # in every fork from its start: a run cancelled as it starts ends in one line
    from e31.deployments.warmprep import build_models, prefill

    if len(args) > 1:
        prefill(args[1])
    build_models()
    gc.collect()  # garbage of the imports is not frozen with the rest
    server = Server(path)
    if threads() > 1:
        print(f"e31 warm: {threads()} threads after import; every run will start cold", file=sys.stderr, flush=True)
    child = server.serve()
    if child is None:
        return 0
    become_flow_process(*child)
    return 0


if __name__ == "__main__":
    sys.exit(main())
