"""Notice a cancel of the flow run made through the Prefect API or UI.

A flow called as a plain Python function is left in ``Cancelling`` by the
API (see docs/design.md, section 2), so the run task watches its flow run's state
itself and stops the work when it sees ``CANCELLING`` or ``CANCELLED``.  The
API is read from a background thread: the supervisor's loop never waits on
it, so a slow or lost API cannot delay a stop.
"""

from __future__ import annotations

import contextvars
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType

from e31.states import PREEMPTED, PREEMPTING
from e31.tasks.supervisor.fence import superseded, this_node

POLL_EVERY_S = 2.0  # seconds between state reads
#: Seconds between state reads in a flow process an ``e31 worker`` started (``E31_NODE`` set): its worker
#: sends SIGTERM as soon as it sees a cancel (Prefect's cancellation observer, on the server's events), and a
#: signal is told apart from a cancel's by a fresh read (:func:`cancel_requested`, :meth:`CancelWatcher.refresh`);
#: the reads remain for a cancel the worker cannot deliver (it died) and for fencing
#: (:mod:`e31.tasks.supervisor.fence`).  Measured: 2.4 reads per 3 s queued job at 2 s.
POLL_UNDER_WORKER_S = 10.0


def cancel_requested(flow_run_id: str | None) -> bool:
    """True when the flow run ``flow_run_id`` is ``Cancelling`` or
    ``Cancelled`` now (one read of the API; an error or no id: False).  It
    always reads, even while a :class:`CancelWatcher` of the run runs: it
    answers whether a signal that just came was a cancel's (Prefect's worker
    sends SIGTERM when it sees one), which a read made before it cannot say."""
    if flow_run_id is None:
        return False
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
    except Exception:
        return False
    return state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)


#: Seconds between a reader's looks for its nudge (:func:`nudge`): a stat of one file.
NUDGE_CHECK_S = 0.25


def nudge_path(flow_run_id: str) -> Path:
    """The file whose presence makes this machine's reader of the flow run ``flow_run_id`` read its state at
    once (:func:`nudge`): in ``$TMPDIR/e31-nudge-<uid>``."""
    return Path(tempfile.gettempdir()) / f"e31-nudge-{os.getuid()}" / str(flow_run_id)


def nudge(flow_run_id: str) -> bool:
    """Make the reader of the flow run ``flow_run_id`` on this machine read its state within
    :data:`NUDGE_CHECK_S` seconds rather than at its next poll (up to :data:`POLL_UNDER_WORKER_S`): an
    ``e31 worker`` does so when the queue preempts one of its runs (``prefect.flow-run.Preempting``, an
    event Prefect's own worker does not act on).  A file, not a signal: a signal that came before the flow
    process's handlers were in place would end it.  The reader removes it.  Returns whether it was
    written."""
    path = nudge_path(flow_run_id)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        return True
    except OSError:
        return False


class _Reader:
    """The background thread that reads one flow run's state every
    :data:`POLL_EVERY_S` seconds (:data:`POLL_UNDER_WORKER_S` in a flow
    process of an ``e31 worker``) for every :class:`CancelWatcher` of that run
    in this process (staging, the wait for the run ahead and the run watch
    the same run: each read its state at its start and every 2 s, ~4 reads
    per short job that one reader makes 1-2).  Ends when its last watcher stops."""

    def __init__(self, flow_run_id: str) -> None:
        self.flow_run_id = flow_run_id
        self.node = this_node()
        self.every = POLL_EVERY_S if self.node is None else POLL_UNDER_WORKER_S
        self.users = 0  # watchers attached (guarded by _READERS_LOCK)
        self.seen = threading.Event()
        self.moved_to: str | None = None  # the other node the run was placed on (fencing: e31.tasks.supervisor.fence)
        self.last = None  # the flow run as last read (a Prefect FlowRun: its tags and run_count)
        self.preempting = False  # the cancel seen is the queue's preemption (a Cancelling named Preempting)
        self.message: str | None = None  # the message of the cancelling state seen
        self.wake = threading.Event()
        self.polled = threading.Condition()
        self.polls = 0
        self.failures_in_row = 0
        self.done = False
        # in a copy of this context: the Prefect settings (API URL) in force here apply there
        threading.Thread(target=contextvars.copy_context().run, args=(self._loop,), name="e31-cancel-watch",
                         daemon=True).start()

    def _wait(self) -> None:
        """Until the next read: :attr:`every` seconds, or less when woken (:meth:`CancelWatcher.refresh`) or
        nudged (:func:`nudge`: its worker heard of a preemption)."""
        until = time.monotonic() + self.every
        marker = nudge_path(self.flow_run_id)
        while not self.done:
            left = until - time.monotonic()
            if left <= 0 or self.wake.wait(min(left, NUDGE_CHECK_S)):
                return
            if marker.exists():
                marker.unlink(missing_ok=True)
                return

    def _loop(self) -> None:
        client = None  # one client for the thread's life (one connection, not a new client every poll)
        try:
            while not self.done and not self.seen.is_set() and self.moved_to is None:
                try:
                    if client is None:
                        entered = get_client(sync_client=True)
                        entered.__enter__()
                        client = entered
                    run = client.read_flow_run(self.flow_run_id)
                    self.last = run
                    self.failures_in_row = 0
                    self.moved_to = self.moved_to or superseded(run, self.node)  # fencing: placed elsewhere, or lost
                    if run.state is not None and run.state.type in (StateType.CANCELLING, StateType.CANCELLED):
                        self.preempting = run.state.name in (PREEMPTING, PREEMPTED)  # before seen: read after it
                        self.message = run.state.message
                        self.seen.set()
                except Exception:
                    self.failures_in_row += 1
                with self.polled:
                    self.polls += 1
                    self.polled.notify_all()
                self._wait()
                self.wake.clear()
        finally:
            if client is not None:
                try:
                    client.__exit__(None, None, None)
                except Exception:  # closing a client whose server is gone: nothing to keep
                    pass


_READERS: dict[str, _Reader] = {}  # flow run id -> its reader, while a watcher of it runs
_READERS_LOCK = threading.Lock()


class CancelWatcher:
    """``cancelled()`` is True once the flow run ``flow_run_id`` was seen
    being cancelled.  An API error counts as "not cancelled" (the run goes
    on).  The watchers of one flow run in a process share one reader
    (:class:`_Reader`): a watcher started while another runs reads nothing
    at its start.  Call :meth:`stop` when done."""

    def __init__(self, flow_run_id: str | None):
        self.flow_run_id = flow_run_id
        self._reader: _Reader | None = None
        self._never = threading.Event()  # the seen event of a watcher without a run id
        self._stopped = False
        if flow_run_id is not None:
            with _READERS_LOCK:
                reader = _READERS.get(flow_run_id)
                if reader is None or reader.done:
                    reader = _READERS[flow_run_id] = _Reader(flow_run_id)
                reader.users += 1
            self._reader = reader

    def cancelled(self) -> bool:
        """True once a cancel was seen (never blocks)."""
        return self._reader is not None and self._reader.seen.is_set()

    def preempted(self) -> bool:
        """True once the cancel seen is the queue's preemption of the run
        (``Cancelling`` named :data:`e31.states.PREEMPTING`): the stop's
        reason is ``preempted``, not ``cancelled`` (never blocks)."""
        return self.cancelled() and self._reader is not None and self._reader.preempting

    def stop_reason(self) -> str:
        """The reason of the stop a cancel seen makes: ``preempted`` or ``cancelled``."""
        return "preempted" if self.preempted() else "cancelled"

    def cancel_message(self) -> str | None:
        """The message of the cancelling state seen (the queue's words of a preemption), or None."""
        return self._reader.message if self._reader is not None and self.cancelled() else None

    def moved_to(self) -> str | None:
        """The other node the run was seen placed on (once seen, for good):
        this process must stop and write nothing more
        (:mod:`e31.tasks.supervisor.fence`); None while the run is this
        node's (never blocks)."""
        return self._reader.moved_to if self._reader is not None else None

    def api_alive(self) -> bool:
        """False once the last two reads of the flow run failed (the Prefect
        API does not answer); never blocks."""
        return self._reader is None or self._reader.failures_in_row < 2

    @property
    def seen(self) -> threading.Event:
        """The event set when a cancel is seen (for others to wait on or test; do not set it)."""
        return self._reader.seen if self._reader is not None else self._never

    def refresh(self, timeout_s: float = 3.0) -> bool:
        """Read the state now (waiting at most ``timeout_s`` seconds for the
        answer) and return :meth:`cancelled`."""
        reader = self._reader
        if reader is None or reader.seen.is_set():
            return self.cancelled()
        with reader.polled:
            target = reader.polls + 1
            reader.wake.set()
            reader.polled.wait_for(lambda: reader.polls >= target or reader.seen.is_set(), timeout=timeout_s)
        return reader.seen.is_set()

    def stop(self) -> None:
        """Detach from the reader (once; what it saw stays readable here);
        the last watcher of a run ends its thread."""
        reader = self._reader
        if reader is None or self._stopped:
            return
        self._stopped = True
        with _READERS_LOCK:
            reader.users -= 1
            if reader.users == 0:
                reader.done = True
                reader.wake.set()
                if _READERS.get(reader.flow_run_id) is reader:
                    del _READERS[reader.flow_run_id]


@contextmanager
def watching(flow_run_id: str | None) -> Iterator[CancelWatcher]:
    """A :class:`CancelWatcher` of ``flow_run_id`` for the block: the
    watchers started within it share its reader (``run_job`` holds one from
    staging to the return)."""
    watcher = CancelWatcher(flow_run_id)
    try:
        yield watcher
    finally:
        watcher.stop()


def cancel_seen(flow_run_id: str | None) -> bool:
    """Whether this process's reader of the flow run (a watcher of it runs:
    ``run_job`` holds one from staging to the return) has seen it
    cancelled, as of its last read (at most :data:`POLL_EVERY_S` seconds
    ago, :data:`POLL_UNDER_WORKER_S` under an ``e31 worker``); without a reader, one read now (:func:`cancel_requested`)."""
    reader = _READERS.get(flow_run_id) if flow_run_id is not None else None
    if reader is None or reader.done:
        return cancel_requested(flow_run_id)
    return reader.seen.is_set()


def cancel_reason(flow_run_id: str | None) -> str:
    """The reason of the stop the cancel this process's reader of the flow
    run saw makes: ``preempted`` for the queue's preemption (``Cancelling``
    named :data:`e31.states.PREEMPTING`), else ``cancelled``."""
    reader = _READERS.get(flow_run_id) if flow_run_id is not None else None
    return "preempted" if reader is not None and reader.seen.is_set() and reader.preempting else "cancelled"


def moved_to(flow_run_id: str | None) -> str | None:
    """The other node the flow run was seen placed on by this process's
    reader of it (:meth:`CancelWatcher.moved_to`); None when it was not, or
    no watcher of the run runs here."""
    reader = _READERS.get(flow_run_id) if flow_run_id is not None else None
    return reader.moved_to if reader is not None else None


_STAGING: dict[str, threading.Event] = {}  # data folder -> set once its flow run is seen cancelled
_STAGING_LOCK = threading.Lock()


@contextmanager
def cancel_stops_staging(flow_run_id: str | None, data_dir: str) -> Iterator[CancelWatcher]:
    """While the inputs are staged into ``data_dir``: watch the flow run
    (every :data:`POLL_EVERY_S` seconds) and, once it is cancelled, let the
    transfers into ``data_dir`` see it (:func:`staging_stop`), so they stop
    within a chunk instead of running to the end."""
    watcher = CancelWatcher(flow_run_id)
    with _STAGING_LOCK:
        _STAGING[data_dir] = watcher.seen
    try:
        yield watcher
    finally:
        with _STAGING_LOCK:
            _STAGING.pop(data_dir, None)
        watcher.stop()


_GATES: dict[str, Callable[[int], None]] = {}  # data folder -> the prefetcher's gate of its transfers


@contextmanager
def gate_staging(data_dir: str, gate: Callable[[int], None]) -> Iterator[None]:
    """While the block runs, every staging transfer into ``data_dir`` calls
    ``gate(bytes_done)`` at each chunk (see
    :class:`e31.tasks.storage.progress.TransferProgress`): the prefetcher
    pauses, caps or stops its transfers with it."""
    with _STAGING_LOCK:
        _GATES[data_dir] = gate
    try:
        yield
    finally:
        with _STAGING_LOCK:
            _GATES.pop(data_dir, None)


def staging_gate(data_dir: str) -> Callable[[int], None] | None:
    """The gate :func:`gate_staging` set for ``data_dir``, or None."""
    with _STAGING_LOCK:
        return _GATES.get(data_dir)


def staging_stop(data_dir: str) -> threading.Event | None:
    """The event set when the flow run staging into ``data_dir`` is
    cancelled, or None when nobody watches (a stage called on its own)."""
    with _STAGING_LOCK:
        return _STAGING.get(data_dir)
