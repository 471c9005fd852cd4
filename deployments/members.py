"""An ``e31 worker``'s members: the processes it starts for gangs that include its node.

A multi-node run's flow process starts on its lead node; every other node of its placement is named by a
tag ``e31-member:NODE`` (:data:`e31.flows.queue.mapping.MEMBER_TAG`).  :class:`MemberRunner`, a thread of
the worker, reads the work pool's ``Placed``, ``Pending`` and ``Running`` runs with its node's tag when the
scheduler announces such a placement (:meth:`MemberRunner.wake`, from the worker's events) and every
:data:`POLL_S` seconds besides, and starts ``python -m e31.flows.gang.member RUN_ID`` for each attempt of
such a run, once, and again for each new try of the lead's work within the attempt (its rendezvous' new token:
a failed work tried again); :mod:`e31.flows.gang.member` does the rest: it stages the inputs while the
lead's flow process starts, and ends when the run leaves ``Running``.  The member
gets ``E31_NODE`` and its GPU devices on this node (``E31_GPU_DEVICES``, ``CUDA_VISIBLE_DEVICES``); its
output goes to ``<scratch>/<job>/member/member.log``.  A member dies with this thread (Linux's parent-death
signal), so a worker killed leaves no member behind; a worker stopping sends each member SIGTERM, which it
passes on to its work as the stop warning.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["POLL_S", "MemberRunner", "attempt_served"]

#: Seconds between the runner's reads of the runs its node is a member of, when no announcement woke it (each
#: is one request to the server, from every worker).
POLL_S = 5.0
#: Seconds between reads while a member here has ended and its run may go on (a failed work tried again
#: publishes a new rendezvous, and its member starts at the next read).
RETRY_POLL_S = 1.0
#: The exit status written for a member this worker could not start (as a member that cannot stage).
EXIT_NOT_STARTED = 2


def attempt_served(run: Any) -> int:
    """The attempt (Prefect's ``run_count`` once ``Running``) a member started now would serve: a
    ``Placed`` or ``Pending`` run's next one, a ``Running`` run's current one."""
    count = int(getattr(run, "run_count", 0) or 0)
    return count if getattr(getattr(run, "state", None), "type", None) is not None and \
        run.state.type.value == "RUNNING" else count + 1


@dataclass
class _Member:
    proc: subprocess.Popen | None  # None: it could not be started
    attempt: int
    after: str | None = None  # the try of the lead's work it was not to serve (an earlier member served it)
    accounted: bool = False  # its end is written on the run (by itself, or by the runner for it)

    def code(self) -> int | None:
        """Its exit status (2 when it could not be started), or None while it runs."""
        return EXIT_NOT_STARTED if self.proc is None else self.proc.poll()


class MemberRunner:
    """Starts and tracks this node's members (see the module docstring).  ``say``: a line for the
    worker's log."""

    def __init__(self, work_pool: str, node: str, say: Callable[[str], None]) -> None:
        self.work_pool, self.node, self.say = work_pool, node, say
        self.members: dict[str, _Member] = {}  # flow run id -> its newest member process here
        self._stop, self._woken = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"e31-members-{node}", daemon=True)

    def start(self) -> None:
        """Start reading (in the runner's own thread)."""
        self._thread.start()

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop reading; warn each member still running (SIGTERM) and wait up to ``grace_s`` seconds for
        them to end (they are killed with the thread after)."""
        self.drain(signal.SIGTERM)
        self._stop.set()
        self._woken.set()
        for member in list(self.members.values()):
            if member.proc is None:
                continue
            try:
                member.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def wake(self) -> None:
        """Read the runs now (a placement naming this node's member was announced)."""
        self._woken.set()

    def drain(self, signum: int = signal.SIGTERM) -> int:
        """Send ``signum`` to every member still running; returns how many."""
        told = 0
        for member in self.members.values():
            if member.proc is not None and member.proc.poll() is None:
                try:
                    member.proc.send_signal(signum)
                    told += 1
                except ProcessLookupError:
                    pass
        return told

    def _loop(self) -> None:
        from prefect.client.orchestration import get_client

        while not self._stop.is_set():
            try:
                with get_client(sync_client=True) as client:
                    while not self._stop.is_set():
                        self._woken.clear()
                        self.poll(client)
                        # a member that ended while its run goes on may have a new try to serve soon
                        ended = any(m.code() is not None for m in self.members.values())
                        self._woken.wait(RETRY_POLL_S if ended else POLL_S)
            except Exception as exc:  # the API is away: try again at the next poll
                self.say(f"members: cannot read the runs of node {self.node}: {type(exc).__name__}")
                self._stop.wait(POLL_S)
        # the members die with this thread (their parent-death signal): wait for them here, so they get
        # their warning's grace when the worker stops
        for member in self.members.values():
            if member.proc is None:
                continue
            try:
                member.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                member.proc.kill()

    def poll(self, client: Any) -> list[str]:
        """Start a member for each run with this node's member tag, ``Placed``, ``Pending`` or ``Running``,
        whose attempt has none here yet; returns the flow run ids started."""
        from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                    FlowRunFilterTags, WorkPoolFilter, WorkPoolFilterName)
        from prefect.client.schemas.objects import StateType

        from e31.flows.gang.rendezvous import member_token, published
        from e31.flows.queue.mapping import MEMBER_TAG, PLACED
        from e31.tasks.placement_record import record_of

        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[MEMBER_TAG + self.node]),
                                          state=FlowRunFilterState(type=FlowRunFilterStateType(
                                              any_=[StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING]))),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[self.work_pool])))
        started = []
        for run in runs:
            if run.state is not None and run.state.type == StateType.SCHEDULED and run.state.name != PLACED:
                continue  # queued again (its tags as last written): placed nowhere now
            key, attempt = str(run.id), attempt_served(run)
            have, after = self.members.get(key), None
            if have is not None and have.code() is None:
                continue
            if have is not None and not have.accounted:
                self._account(client, run, have)
            if have is not None and have.attempt >= attempt:
                # this attempt's member ended: another starts only for a new try of the lead's work
                served, pub = member_token(run, record_of(run).rank_of(self.node) or 0), published(run)
                if pub is None or pub.attempt != attempt or served is None or pub.token == served:
                    continue
                after = served
            self.members[key] = _Member(self._spawn(run, after), attempt, after)
            started.append(key)
        for key in [k for k, m in self.members.items() if m.code() is not None and k not in
                    {str(r.id) for r in runs}]:
            del self.members[key]  # ended, and its run no longer names this node's member
        return started

    def _account(self, client: Any, run: Any, member: _Member) -> None:
        """A member that ended with a failure before writing its end for the try of the lead's work it was to
        serve (it could not be started, could not stage its inputs, or was killed): write its exit status for
        that try on the run, once the lead has published it, so the lead stops its own work rather than wait
        for a peer that never comes (:func:`e31.flows.gang.lead.member_failed`).  A member that ended well or
        found its run ended (exit 0 or 3) needs nothing."""
        from dataclasses import replace

        from e31.flows.gang.member import EXIT_RUN_ENDED
        from e31.flows.gang.rendezvous import member_token, published, report_member
        from e31.tasks.placement_record import record_of

        code = member.code()
        if code in (0, EXIT_RUN_ENDED):
            member.accounted = True
            return
        pub, rank = published(run), record_of(run).rank_of(self.node)
        if not rank or pub is None or pub.attempt != member.attempt:
            return
        try:  # the try it met, when it got that far; else the first one published after ``after``
            served = self._serving(run).read_text().strip() or None
        except OSError:
            served = None
        if served is None and pub.token == member.after:
            return  # the try it was to serve is not published yet
        member.accounted = True
        pub = replace(pub, token=served or pub.token)
        if member_token(run, rank) != pub.token:
            report_member(client, str(run.id), rank, pub, code)
            self.say(f"flow run {run.id}: its member on node {self.node} ended with exit status {code} before "
                     "saying so; written for it")
            log_on_run(str(run.id), f"member rank {rank} on node {self.node} ended with exit status {code} before "
                       f"saying so (its own lines: {self._serving(run).parent.parent / 'member.log'} there)")

    @staticmethod
    def _serving(run: Any) -> Path:
        """The file where the member of ``run`` on this node names the try it serves
        (:data:`e31.flows.gang.member.SERVING`)."""
        from e31.flows.compile import default_scratch_root
        from e31.flows.gang.member import SERVING

        job = str(((run.parameters or {}).get("spec") or {}).get("name") or "job")
        return Path(default_scratch_root()) / job / "member" / "run" / SERVING

    def _spawn(self, run: Any, after: str | None = None) -> subprocess.Popen | None:
        from e31.deployments.leftovers import MEMBER_VAR
        from e31.flows.compile import default_scratch_root
        from e31.tasks.placement_record import record_of
        from e31.tasks.supervisor.process import die_with_parent

        devices = dict(record_of(run).gang).get(self.node, ())
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT__FLOW_RUN")}
        env.update({"E31_NODE": self.node, "E31_GPU_DEVICES": ",".join(map(str, devices)),
                    "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices)),
                    MEMBER_VAR: str(run.id)})  # its processes found by the fence check (e31.deployments.leftovers)
        job = str(((run.parameters or {}).get("spec") or {}).get("name") or "job")
        log = Path(default_scratch_root()) / job / "member" / "member.log"
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            self._serving(run).unlink(missing_ok=True)  # an earlier member's: this one names its own try
            with open(log, "ab") as out:
                proc = subprocess.Popen([sys.executable, "-m", "e31.flows.gang.member", str(run.id),
                                         *(["--after", after] if after else [])], env=env,
                                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        preexec_fn=die_with_parent)
        except OSError as exc:  # a scratch that cannot be written (full, read-only, not a folder)
            self.say(f"flow run {run.id}: cannot start its member on node {self.node}: {exc}")
            log_on_run(str(run.id), f"member on node {self.node}: its e31 worker cannot start it: {exc}")
            return None
        self.say(f"flow run {run.id}: started its member on node {self.node} (pid {proc.pid})")
        return proc


def log_on_run(run_id: str, line: str, level: int = 40) -> None:
    """Put ``line`` (masked) in the flow run ``run_id``'s log, as ``e31.member`` (best effort: the worker's
    own output has it too)."""
    from datetime import datetime, timezone

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import LogCreate

    from e31.tasks.storage import scrub

    try:
        with get_client(sync_client=True) as client:
            client.create_logs([LogCreate(name="e31.member", level=level, message=scrub(line),
                                          timestamp=datetime.now(timezone.utc), flow_run_id=run_id)])
    except Exception:
        pass

