"""The flow-process command of ``e31 worker`` when warm starts are on.

    python -S .../deployments/warmstart_client.py SOCKET

Prefect's process worker starts this command for each flow run, with the
run's environment, exactly as it would start ``python -m prefect.engine``.
It imports only the standard library (``-S``: no site packages), connects to
the worker's warm flow process (:mod:`e31.deployments.warmstart`) over the Unix
socket ``SOCKET`` and hands it its environment, working folder and standard
streams (fds 0, 1 and 2, passed with ``SCM_RIGHTS``).  The warm process forks
a child that already has Prefect and E31 imported; the child runs the flow
run as ``python -m prefect.engine`` would (with this process's standard
input; it writes to the worker's own output, not to the pipes Prefect's
worker reads: a killed worker must not take its runs with it).

This process stays as the flow process Prefect knows (its pid is the run's
infrastructure pid): it forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1
and SIGUSR2 to the child and ends as the child ended (its exit status, or
killed by the same signal).  If it is killed itself (SIGKILL), the child sees
its connection close and kills itself with SIGKILL too.

The environment it hands over adds ``E31_FLOW_PROCESS_PID``, this process's
pid: the run's transfer markers carry the pid the worker knows
(:func:`e31.tasks.storage.transfer_markers.flow_process_pid`).

If the warm process cannot be reached, or it answers ``cold`` (the run's
Prefect settings differ from those it imported with), or it does not answer
within :data:`ANSWER_S` seconds (a stopped or stuck one: a late fork finds
this end closed and ends before the run starts), this process becomes
``python -m prefect.engine`` in place (``exec``): the run starts cold, never
not at all.

Protocol (one connection per flow run; lines of ASCII from the warm side):
a 4-byte big-endian length with the three fds, then that many bytes of JSON
``{"env": {...}, "cwd": "..."}``; answers ``pid N``, then ``exit N`` or
``signal N`` once the child is reaped, or ``cold``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

#: Seconds the client waits for the warm process's first answer (``pid N`` or ``cold``; it answers
#: within milliseconds) before it starts the run cold itself (``E31_WARM_ANSWER_S`` overrides): a
#: stopped warm process held its runs in ``Submitting`` for as long as it was stopped.
ANSWER_S = 20.0
ANSWER_VAR = "E31_WARM_ANSWER_S"

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def cold(pending: list[int]) -> None:
    """Become ``python -m prefect.engine`` with this environment (never
    returns); a signal that came meanwhile (``pending``) ends this process
    as it would have ended a cold one that was starting."""
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_DFL)
    for signum in pending:
        os.kill(os.getpid(), signum)
    os.execv(sys.executable, [sys.executable, "-m", "prefect.engine"])


def main(path: str) -> int:
    """Run the flow run through the warm process at ``path``; returns the
    child's exit status (or kills this process with the child's signal)."""
    pending: list[int] = []
    child: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if child:
            try:
                os.kill(child[0], signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        # the pid Prefect's worker knows, which names the run's transfer markers (e31.tasks.storage.transfer_markers)
        env = {**os.environ, "E31_FLOW_PROCESS_PID": str(os.getpid())}
        header = json.dumps({"env": env, "cwd": os.getcwd()}).encode()
        socket.send_fds(conn, [struct.pack("!I", len(header))], [0, 1, 2])
        conn.sendall(header)
    except OSError:
        cold(pending)
    stream = conn.makefile("rb")
    outcome: tuple[str, int] | None = None
    conn.settimeout(float(os.environ.get(ANSWER_VAR) or ANSWER_S))  # for its first answer only
    while True:
        try:
            line = stream.readline()
        except TimeoutError:  # a warm process that does not answer (stopped, stuck): never wait for it
            if not child:
                conn.close()
                cold(pending)
            line = b""
        except OSError:  # the warm process died while it read the request: as at EOF
            line = b""
        conn.settimeout(None)
        if not line:
            break
        word, _, value = line.decode("ascii", errors="replace").strip().partition(" ")
        if word == "cold" and not child:
            conn.close()
            cold(pending)
        elif word == "pid":
            child.append(int(value))
            for signum in pending:
                forward(signum, None)
        elif word in ("exit", "signal"):
            outcome = (word, int(value))
    if outcome is None:  # the warm process died before it could reap the child: its status is lost
        if not child:
            cold(pending)  # it died before it started the run: start it here
        return 1
    word, value = outcome
    if word == "signal":
        try:
            signal.signal(value, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP: no handler to reset
            pass
        os.kill(os.getpid(), value)
        return 128 + value
    return value


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
