"""One ``e31 scheduler`` per pool, and what it tells ``e31 queue``.

Two schedulers on one pool would each place runs on the same free
resources (each plans against what it read, before the other's placements
land), so a second one waits as a standby.  Each scheduler keeps a Prefect
Variable named after its pool (:func:`variable_name`) holding its identity,
its ``--lease`` and its last beat (Unix seconds on the Prefect server's
clock: :func:`e31.prefect_compat.clock.server_now`), written every
:data:`BEAT_S` seconds by a thread of its own (:class:`Beats`: a long
tick does not hold it back) and deleted when it stops.  A scheduler starting
while another's beat is younger than :data:`STALE_S` seconds waits, and
takes over once that beat is older (the other was killed); two starting at
once both write, read back after :data:`SETTLE_S`, and the one whose claim
was overwritten waits.  A scheduler that finds, at a beat, another's
younger claim stops placing and waits too.

``e31 queue`` reads the same variable for the lease a silent node's runs
are held to (:func:`lease_of`).  A Prefect Variable is the server's own
key-value store (Prefect's UI lists it under Variables): no second
database.

Why not a global concurrency limit of 1 with a lease (Prefect 3.9.1:
``increment_concurrency_slots_with_lease``, ``renew_concurrency_lease``;
measured on 3.9.1): its acquisition is atomic (no :data:`SETTLE_S`
read-back), but the server refuses a ``lease_duration`` under 60 s (422)
and frees an expired lease at its repossessor's pass (every 15 s): a
slot whose 60 s lease was never renewed went to a second holder 72 s
later, where a killed scheduler's pool goes to its standby after
:data:`STALE_S` (30 s); and a lease's holder can only be a flow run, task
run or deployment id, so it cannot say which scheduler serves, its
``--lease`` or when it was last heard, which ``e31 queue`` and ``e31
submit`` read here (:func:`lease_of`, :func:`scheduler_note`): the
Variable would still be needed beside it.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Callable

from e31.prefect_compat.clock import server_now

#: Seconds between a scheduler's beats.
BEAT_S = 10.0
#: Seconds after which a scheduler's beat no longer holds the pool (it was killed without deleting its claim).
STALE_S = 3 * BEAT_S
#: Seconds between a standby's reads of the pool's claim.
STANDBY_POLL_S = 2.0
#: Seconds a starting scheduler waits before reading its claim back (another one started at the same moment).
SETTLE_S = 1.0


class SchedulerRunning(RuntimeError):
    """Another ``e31 scheduler`` serves the pool (its claim is younger than
    :data:`STALE_S` seconds)."""


def variable_name(pool_name: str) -> str:
    """The Prefect Variable of the pool named ``pool_name``:
    ``e31-scheduler-<name>`` (letters lowercased; a character a Variable
    name cannot hold, such as ``.``, becomes ``_`` and the name gains 8 hex
    digits of the pool name's SHA-256, so two pools never share one)."""
    safe = re.sub(r"[^a-z0-9_-]", "_", pool_name.lower())
    if safe != pool_name:
        safe += "-" + hashlib.sha256(pool_name.encode()).hexdigest()[:8]
    return f"e31-scheduler-{safe}"


def new_identity() -> str:
    """This scheduler's identity: ``HOST-PID-hex``."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def read_claim(client: Any, pool_name: str) -> dict[str, Any] | None:
    """The pool's scheduler claim (``{"id", "lease_s", "beat"}``), or None."""
    variable = client.read_variable_by_name(variable_name(pool_name))
    value = getattr(variable, "value", None)
    return value if isinstance(value, dict) and "id" in value else None


def _write(client: Any, pool_name: str, claim: dict[str, Any]) -> None:
    from prefect.client.schemas.actions import VariableCreate, VariableUpdate

    name = variable_name(pool_name)
    if client.read_variable_by_name(name) is None:
        try:
            client.create_variable(VariableCreate(name=name, value=claim))
            return
        except Exception:  # created by another one meanwhile: update it
            pass
    client.update_variable(VariableUpdate(name=name, value=claim))


def _other(claim: dict[str, Any] | None, me: str, now: float) -> dict[str, Any] | None:
    """``claim`` when it is another live scheduler's (beat within :data:`STALE_S`)."""
    if claim is None or claim.get("id") == me:
        return None
    beat = claim.get("beat")
    return claim if isinstance(beat, (int, float)) and now - beat < STALE_S else None


def _serving(pool_name: str, claim: dict[str, Any], now: float) -> str:
    return (f"another e31 scheduler serves pool {pool_name} ({claim['id']}, heard "
            f"{max(0.0, now - claim['beat']):.0f} s ago): one scheduler per pool, or both would place runs on the "
            "same resources")


def claim_pool(client: Any, pool_name: str, me: str, lease_s: float, standby: bool = True,
               say: Any = print) -> None:
    """Claim the pool for the scheduler ``me`` (:func:`new_identity`) with
    its lease (seconds); returns once it holds it.  While another live
    scheduler holds it, this one waits as a standby (``say`` is told once,
    and once more as it takes over), and takes over :data:`STALE_S` seconds after that one's last beat (it
    was killed without releasing the pool).  ``standby`` False: raises
    :class:`SchedulerRunning` instead (``e31 scheduler --once``)."""
    told = False
    while True:
        now = server_now()
        try:
            other = _other(read_claim(client, pool_name), me, now)
            if other is None:
                _write(client, pool_name, {"id": me, "lease_s": lease_s, "beat": now})
                time.sleep(SETTLE_S)  # another one starting at the same moment: the claim written last serves
                if _other(read_claim(client, pool_name), me, server_now()) is None:
                    if told:
                        say(f"{datetime.fromtimestamp(server_now(), timezone.utc):%H:%M:%S} e31 scheduler: the pool's scheduler has "
                            f"stopped; this one serves pool {pool_name} now", flush=True)
                    return
                continue
        except Exception:  # the API is busy or away (Prefect's client retried already): try again shortly
            if not standby:
                raise
            time.sleep(STANDBY_POLL_S)
            continue
        if not standby:
            raise SchedulerRunning(_serving(pool_name, other, now) + "; stop that one first")
        if not told:
            say(f"e31 scheduler: {_serving(pool_name, other, now)}; this one waits as a standby and takes over "
                f"{STALE_S:g} s after that one's last beat", flush=True)
            told = True
        time.sleep(STANDBY_POLL_S)  # a stopped scheduler deletes its claim: take over within seconds


def beat(client: Any, pool_name: str, me: str, lease_s: float) -> bool:
    """Renew ``me``'s claim (every :data:`BEAT_S` seconds).  Returns False,
    writing nothing, when another live scheduler's claim replaced it (two
    started at once; or this one was stopped, as by a suspended laptop, for
    longer than :data:`STALE_S`, and a standby took over)."""
    now = server_now()
    if _other(read_claim(client, pool_name), me, now) is not None:
        return False
    _write(client, pool_name, {"id": me, "lease_s": lease_s, "beat": now})
    return True


#: Seconds a stopping scheduler gives the deletion of its claim: a server that is down or frozen would
#: otherwise hold its stop for the client's retries and timeouts (16 s measured after a SIGTERM, then the operator's kill -9).
RELEASE_WAIT_S = 5.0


def release_pool(client: Any, pool_name: str, me: str, wait_s: float = RELEASE_WAIT_S) -> bool:
    """Delete ``me``'s claim as it stops, so a scheduler started next
    serves at once.  Best effort (another's claim is left alone), and given
    at most ``wait_s`` seconds (in a daemon thread): a claim left behind
    goes stale after :data:`STALE_S`.  Returns whether it finished in time."""
    import threading

    def release() -> None:
        try:
            claim = read_claim(client, pool_name)
            if claim is not None and claim.get("id") == me:
                client.delete_variable_by_name(variable_name(pool_name))
        except Exception:
            pass

    worker = threading.Thread(target=release, name="e31-release-pool", daemon=True)
    worker.start()
    worker.join(wait_s)
    return not worker.is_alive()


def lease_of(client: Any, pool_name: str, default: float) -> tuple[float, bool]:
    """The lease (seconds) of the pool's live scheduler and True, or
    ``default`` and False when no scheduler's beat is younger than
    :data:`STALE_S` (or it cannot be read)."""
    try:
        claim = read_claim(client, pool_name)
    except Exception:
        return default, False
    if _other(claim, "", server_now()) is None or not isinstance(claim.get("lease_s"), (int, float)):
        return default, False
    return float(claim["lease_s"]), True


def scheduler_note(client: Any, pool_name: str, pool_file: str, now: float | None = None) -> str | None:
    """A line for ``e31 submit`` and ``e31 queue`` when the pool may have no
    live scheduler: none has beaten within :data:`STALE_S` seconds
    (nothing is placed or started until one runs), or its last beat is
    older than two beats (it may have died: a standby takes over
    :data:`STALE_S` seconds after that beat).  None when one beat recently,
    or when the claim cannot be read (the command says nothing it does not
    know).  ``pool_file``: the pool file's path, for the fix."""
    try:
        claim = read_claim(client, pool_name)
    except Exception:
        return None
    now = server_now() if now is None else now
    beat = claim.get("beat") if claim is not None else None
    if not isinstance(beat, (int, float)) or now - beat >= STALE_S:
        return (f"no e31 scheduler serves pool {pool_name}: the plan shown is what one would do; nothing is placed "
                f"or started until one runs (e31 scheduler --pool {pool_file})")
    if now - beat > 2 * BEAT_S:
        return (f"pool {pool_name}'s e31 scheduler was last heard {now - beat:.0f} s ago (it beats every "
                f"{BEAT_S:g} s): it may have stopped; a standby takes over {STALE_S:g} s after its last beat")
    return None


class Beats:
    """A daemon thread that calls ``send(client)`` every ``every_s`` seconds
    (counted from one call's start to the next's) with a Prefect client of
    its own: a process busy with its own work (a long scheduler tick, a
    CPU-bound step, a blocked event loop) still beats on time; Python's
    interpreter lets another thread run every 5 ms (``sys.getswitchinterval``).
    ``send`` returning False stops it and sets :attr:`lost` (another
    scheduler's claim replaced this one's).  ``alive`` (optional): beat only
    while it answers True (the process's own loop still moves).  ``say``
    (optional): told :class:`e31.prefect_compat.clock.SkewNews` ``news`` (the
    clock's skew against the server's) after each beat."""

    def __init__(self, name: str, every_s: float, send: Callable[[Any], Any],
                 alive: Callable[[], bool] | None = None, say: Callable[[str], None] | None = None,
                 news: Any = None) -> None:
        import threading

        from e31.prefect_compat.clock import SkewNews

        self.name, self.every_s, self.send, self.alive, self.say = name, every_s, send, alive, say
        self.news = news if news is not None else SkewNews()
        self.lost = threading.Event()
        self.sent = 0  # beats sent
        self._stop = threading.Event()
        self._thread: Any = None

    def start(self) -> "Beats":
        """Start beating (the first beat comes ``every_s`` seconds from now)."""
        import contextvars
        import threading

        context = contextvars.copy_context()  # the caller's Prefect settings (temporary_settings) hold here too
        self._thread = threading.Thread(target=context.run, args=(self._run,), name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, wait_s: float = 2.0) -> None:
        """Stop beating; waits at most ``wait_s`` seconds for a beat under way."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)

    def _run(self) -> None:
        from prefect.client.orchestration import get_client

        from e31.prefect_compat.clock import watch
        from e31.prefect_compat.busy import retry_busy_quickly

        with retry_busy_quickly(get_client(sync_client=True)) as client:
            watch(client)
            wait = self.every_s
            while not self._stop.wait(wait):
                started = time.monotonic()
                if self.alive is None or self.alive():
                    try:
                        if self.send(client) is False:
                            self.lost.set()
                            return
                        self.sent += 1
                    except Exception:  # the API is busy or away: the next beat tries again
                        pass
                line = self.news.news() if self.say is not None else None
                if line:
                    self.say(line)
                wait = max(0.0, self.every_s - (time.monotonic() - started))


def scheduler_beats(pool_name: str, me: str, lease_s: float, say: Callable[[str], None] | None = None,
                    news: Any = None) -> Beats:
    """The :class:`Beats` of the scheduler ``me`` on pool ``pool_name``:
    :func:`beat` every :data:`BEAT_S` seconds; :attr:`Beats.lost` is set
    when another scheduler's claim replaced this one's.  Not started."""
    return Beats("e31-scheduler-beats", BEAT_S, lambda client: beat(client, pool_name, me, lease_s), say=say,
                 news=news)


#: Seconds a worker's event loop may stay without moving before its heartbeat thread stops beating: a worker
#: hung for this long takes no run, and its node should go lost rather than look live.
LOOP_STUCK_S = 300.0


def worker_beats(work_pool: str, worker: str, every_s: float, alive: Callable[[], bool],
                 say: Callable[[str], None] | None = None) -> Beats:
    """The :class:`Beats` of ``e31 worker`` ``worker`` on the work pool
    ``work_pool``: Prefect's worker heartbeat (``POST
    /work_pools/{name}/workers/heartbeat``, as Prefect's own loop sends it)
    every ``every_s`` seconds beside Prefect's own, while ``alive()``: a
    busy event loop (a long poll, a slow teardown of a run) no longer delays
    the heartbeat that keeps the node live.  Not started."""
    return Beats("e31-worker-beats", every_s,
                 lambda client: client.send_worker_heartbeat(work_pool, worker, heartbeat_interval_seconds=every_s),
                 alive=alive, say=say)
