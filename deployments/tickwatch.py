"""Say why a scheduler tick is taking long, while it does.

A tick's requests go through Prefect's client, which waits for an answer up
to ``PREFECT_API_REQUEST_TIMEOUT`` (60 s by default) and retries a request
that timed out several times: against a frozen server (a process stopped,
a database holding every connection) one tick can wait for minutes, and a
scheduler that printed nothing meanwhile looked as if it were placing work.
:class:`TickWatch` is a thread beside the loop: once a tick has gone on for
longer than ``E31_API_TIMEOUT_S`` it asks the server's readiness check
(:func:`e31.prefect_compat.api.ready_problem`, with its own time limit, so
it never hangs itself) and prints what it found, again each minute while the
tick still waits; when such a tick ends it says after how long.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone
from typing import Callable

#: Seconds between two lines about the same long tick.
REPEAT_S = 60.0


class TickWatch:
    """Watches one tick at a time: :meth:`begin` as a tick starts,
    :meth:`end` as it ends (either way).  ``api``: the server's API URL
    (ending in ``/api``); ``limit_s``: seconds a tick may take before it is
    said (``E31_API_TIMEOUT_S``); ``say``: prints one line; ``ask``: the
    readiness check (URL, seconds) -> a problem line or None; ``now``: the
    wall clock, for the time of day in the lines (the server's clock where
    the caller has one)."""

    def __init__(self, api: str, limit_s: float, say: Callable[[str], None],
                 ask: Callable[[str, float], str | None] | None = None,
                 now: Callable[[], float] = time.time, poll_s: float = 0.5) -> None:
        if ask is None:
            from e31.prefect_compat.api import ready_problem as ask
        self.api, self.limit_s, self.say, self.ask, self.now, self.poll_s = api, limit_s, say, ask, now, poll_s
        self._lock = threading.Lock()
        self._began: float | None = None  # monotonic start of the tick under way
        self._began_at = ""  # its time of day, HH:MM:SS UTC
        self._said: float | None = None  # monotonic time of the last line about it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="e31-tick-watch", daemon=True)

    def start(self) -> "TickWatch":
        """Start the watching thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the watching thread (a readiness check under way ends within its own limit)."""
        self._stop.set()

    def begin(self) -> None:
        """A tick starts now."""
        with self._lock:
            self._began, self._said = time.monotonic(), None
            self._began_at = f"{datetime.fromtimestamp(self.now(), timezone.utc):%H:%M:%S}"

    def end(self) -> float | None:
        """The tick ends (done or failed); returns its seconds when a line
        was said about it (and says it went on), else None."""
        with self._lock:
            began, said, self._began = self._began, self._said, None
        if began is None or said is None:
            return None
        took = time.monotonic() - began
        self.say(f"the tick begun at {self._began_at} UTC ended after {took:.0f} s")
        return took

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                began, said, at = self._began, self._said, self._began_at
            now = time.monotonic()
            if began is None or now - began < self.limit_s or (said is not None and now - said < REPEAT_S):
                continue
            problem = self.ask(self.api, self.limit_s)
            with self._lock:
                if self._began != began:  # that tick ended while the server was asked
                    continue
                self._said = time.monotonic()
                waited = self._said - began
            if problem is not None:
                problem = problem.removesuffix(", then retry")  # the scheduler itself goes on trying
            else:
                problem = (f"the Prefect server at {self.api} answers its readiness check, so its answers to the "
                           "tick are slow (a large queue, a busy database)")
            self.say(f"the tick begun at {at} UTC has waited {waited:.0f} s on the server: {problem}; it goes on "
                     "when the server answers (Prefect's client gives up on one request after "
                     "PREFECT_API_REQUEST_TIMEOUT s, then retries it)")
