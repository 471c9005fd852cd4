"""What a benchmark started, stopped however it ends: a normal end, an
exception, SIGTERM or SIGINT.

Every benchmark under ``tests/benchmarks/`` runs its ``main`` inside one
:class:`Cleanup`::

    with Cleanup("bench_queue") as cleanup:
        root = cleanup.tempdir("e31-bench-queue-", keep=args.keep)
        server = spawn([sys.executable, "-m", "prefect", "server", "start", ...], server=True, env=env)
        worker = spawn([e31, "worker", ...], env=env)

On entry it puts a marker of its own in ``os.environ`` (``E31_BENCH_RUN``,
a fresh token), so every process the benchmark starts inherits it, also
those that leave its process group or session: the flow processes a warm
``e31 worker`` forks (each in a session of its own; ``/proc/PID/environ``
keeps the environment a process was started with), their works' children,
a SeaweedFS server started by :mod:`tests.s3server`.  A process started
with an environment of its own (``env={...}``) is found while it descends
from the benchmark.

Its stop, in this order (each step also on a normal end):

1. the processes started with :func:`spawn` (each the leader of its own
   session and process group), servers excepted: SIGTERM to each group,
   the last started first, then at most :data:`STOP_GRACE_S` for them all
   to exit;
2. every other process of the run (carrying the marker, descending from
   the benchmark, or in a spawned group) except the servers' groups:
   SIGKILL (a flow process given SIGTERM would start its own stop, a grace
   period and the return of a partial output, which a stopped benchmark
   does not wait for);
3. the servers (``spawn(..., server=True)``: Prefect, S3), last, so the
   others' last calls were answered: SIGTERM, at most :data:`STOP_GRACE_S`;
4. SIGKILL to whatever of the run is still alive, until none is (at most
   :data:`FINAL_S`; the ones left then are named on stderr);
5. its folders (:meth:`Cleanup.folder`, :meth:`Cleanup.tempdir`) are
   removed, except those kept (their paths are printed).

On SIGTERM or SIGINT the benchmark then prints ``NAME: stopped by SIGTERM``
on stderr and exits with 128 + the signal's number (143, 130; the shell's
convention for a death by signal); a second signal during the stop skips
the grace periods left.  Linux only (``/proc``); a process started without
the marker whose parent died before the stop (re-parented to init) escapes it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from e31.tasks.supervisor.process import processes_where

#: The environment variable that marks every process of one benchmark run.
MARK_VAR = "E31_BENCH_RUN"
#: Seconds each of the steps 1 and 3 waits for SIGTERMed groups to exit before going on.
STOP_GRACE_S = 10.0
#: Seconds the last step keeps sending SIGKILL until no process of the run is left.
FINAL_S = 10.0
#: The signals that stop a benchmark.
SIGNALS = (signal.SIGTERM, signal.SIGINT)

_ACTIVE: list[Cleanup] = []  # the Cleanup now entered, if any (one at a time per process)


def _table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every live process, zombies
    left out, from ``/proc/PID/stat``."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and fields[0] not in (b"Z", b"X"):  # a zombie is gone: only its exit status is left
            found[int(name)] = (int(fields[1]), int(fields[2]))
    return found


class Cleanup:
    """The registry of one benchmark run: its processes (``Popen``, each
    the leader of its own process group), its folders, its marker; and the
    SIGTERM/SIGINT handler that stops them (module docstring).  A context
    manager; one entered at a time per process.  ``name``: the benchmark's
    name in its messages (default: the script's file name without ``.py``)."""

    def __init__(self, name: str | None = None):
        self.name = name or Path(sys.argv[0]).stem or "benchmark"
        self.token = uuid.uuid4().hex
        self.procs: list[tuple[subprocess.Popen, bool]] = []  # (process, is a server), in start order
        self.folders: list[tuple[Path, bool]] = []  # (folder, kept)
        self._previous: dict[int, Any] = {}
        self._signalled: int | None = None
        self._stopping = False
        self._hurry = False
        self._mark = f"{MARK_VAR}={self.token}".encode()

    # -- registering --------------------------------------------------------

    def folder(self, path: str | os.PathLike[str], keep: bool = False) -> Path:
        """Register ``path`` (a folder) to be removed at the stop, or, with
        ``keep``, to be kept and named; returns it as a ``Path``."""
        path = Path(path)
        self.folders.append((path, keep))
        return path

    def tempdir(self, prefix: str, keep: bool = False) -> Path:
        """A new folder from ``tempfile.mkdtemp(prefix=prefix)`` (under
        ``TMPDIR``), registered as :meth:`folder` does."""
        return self.folder(tempfile.mkdtemp(prefix=prefix), keep)

    def spawn(self, command: list[str], *, server: bool = False, **popen: Any) -> subprocess.Popen:
        """``subprocess.Popen(command, **popen)`` as the leader of a new
        session (``start_new_session=True``: a group kill reaches its
        descendants, and a Ctrl-C at the terminal does not reach it: the
        benchmark stops it, in order), with the run's marker in its
        environment (``env``, default ``os.environ``); registered for the
        stop, as a server (stopped last) when ``server``.  Raises what
        ``Popen`` raises (``OSError``: the command cannot be started)."""
        popen["env"] = {**(popen.get("env") or os.environ), MARK_VAR: self.token}
        popen["start_new_session"] = True
        proc = subprocess.Popen(command, **popen)
        self.procs.append((proc, server))
        return proc

    def adopt(self, proc: subprocess.Popen, *, server: bool = False) -> subprocess.Popen:
        """Register ``proc``, started elsewhere as the leader of its own
        session (e.g. :class:`tests.s3server.S3Server`'s), as :meth:`spawn` does."""
        self.procs.append((proc, server))
        return proc

    # -- the stop -------------------------------------------------------------

    def ours(self, table: dict[int, tuple[int, int]] | None = None, spare: set[int] = frozenset()) -> list[int]:
        """The live processes of this run, not this one: those carrying its
        marker, those descending from this process, and the members of its
        registered groups; less the members of the groups in ``spare``."""
        table = _table() if table is None else table
        me = os.getpid()
        found = {pid for pid in processes_where(lambda environ: self._mark in environ) if pid in table}
        groups = {proc.pid for proc, _ in self.procs}
        found |= {pid for pid, (_, group) in table.items() if group in groups}
        children: dict[int, list[int]] = {}
        for pid, (parent, _) in table.items():
            children.setdefault(parent, []).append(pid)
        below = list(children.get(me, []))
        while below:
            pid = below.pop()
            found.add(pid)
            below.extend(children.get(pid, []))
        found.discard(me)
        return sorted(pid for pid in found if table.get(pid, (0, 0))[1] not in spare)

    def stop_group(self, proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
        """Stop one registered process group now (SIGTERM, at most ``grace``
        seconds, then SIGKILL) and forget it; e.g. a benchmark's services
        before its baseline runs."""
        self._term([proc], grace)
        self._kill_groups([proc])
        self.procs = [(p, s) for p, s in self.procs if p is not proc]

    def stop(self) -> int:
        """Stop everything of the run and remove its folders (module
        docstring, steps 1-5); returns how many processes were still alive
        when it began.  Safe to call more than once."""
        self._stopping = True
        try:
            alive = len(self.ours())
            servers = [p for p, s in reversed(self.procs) if s]
            others = [p for p, s in reversed(self.procs) if not s]
            self._term(others, STOP_GRACE_S)
            self._kill_groups(others)
            self._kill(spare={p.pid for p in servers}, until=time.monotonic())  # one pass
            self._term(servers, STOP_GRACE_S)
            left = self._kill(spare=set(), until=time.monotonic() + FINAL_S)
            if left:
                self._say(f"{self.name}: processes left after SIGKILL for {FINAL_S:g} s: {left}")
            for proc, _ in self.procs:
                proc.poll()  # reap the leaders: no zombie left behind
            for path, keep in self.folders:
                if keep:
                    self._say(f"{self.name}: kept {path}")
                else:
                    shutil.rmtree(path, ignore_errors=True)
            return alive
        finally:
            self._stopping = False

    def _term(self, procs: list[subprocess.Popen], grace: float) -> None:
        """SIGTERM each group in ``procs``, then wait (at most ``grace``
        seconds; none once a second signal came) until none has a live member."""
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except OSError:  # gone already
                pass
        deadline = time.monotonic() + grace
        groups = {proc.pid for proc in procs}
        while groups and not self._hurry and time.monotonic() < deadline:
            for proc in procs:
                proc.poll()  # a leader that exited is reaped, so no longer counted
            if not any(group in groups for _, group in _table().values()):
                return
            time.sleep(0.05)

    def _kill_groups(self, procs: list[subprocess.Popen]) -> None:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.poll()

    def _kill(self, spare: set[int], until: float) -> list[int]:
        """SIGKILL every process of the run outside the groups ``spare``,
        again until none is left or ``until`` (monotonic seconds) passed
        (at least one pass); returns those left."""
        while True:
            pids = self.ours(spare=spare)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            for proc, _ in self.procs:
                proc.poll()
            if not pids:
                return []
            if time.monotonic() >= until:
                return self.ours(spare=spare)
            time.sleep(0.05)

    @staticmethod
    def _say(line: str) -> None:
        try:
            os.write(2, (line + "\n").encode())  # not print: the signal may have come in the middle of one
        except OSError:
            pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stopping or self._signalled is not None:  # a second signal: no more grace
            self._hurry = True
            self._signalled = self._signalled or signum
            return
        self._signalled = signum
        self.stop()
        self._exit(signum)

    def _exit(self, signum: int) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # e.g. a print interrupted by the signal: its buffer is busy
                pass
        self._say(f"{self.name}: stopped by {signal.Signals(signum).name}")
        os._exit(128 + signum)

    # -- entering and leaving ---------------------------------------------------

    def __enter__(self) -> Cleanup:
        if _ACTIVE:
            raise RuntimeError(f"a Cleanup is already entered in this process ({_ACTIVE[0].name})")
        os.environ[MARK_VAR] = self.token
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop()
        finally:
            _ACTIVE.clear()
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            if os.environ.get(MARK_VAR) == self.token:
                del os.environ[MARK_VAR]
        if self._signalled is not None:  # a signal came during the stop of a normal end
            self._exit(self._signalled)


def active() -> Cleanup:
    """The :class:`Cleanup` now entered in this process; raises
    ``RuntimeError`` when none is (a benchmark must run inside one)."""
    if not _ACTIVE:
        raise RuntimeError("no Cleanup entered: run the benchmark's main inside `with Cleanup(...)`")
    return _ACTIVE[0]


def spawn(command: list[str], *, server: bool = False, **popen: Any) -> subprocess.Popen:
    """:meth:`Cleanup.spawn` of the :class:`Cleanup` now entered (:func:`active`)."""
    return active().spawn(command, server=server, **popen)
