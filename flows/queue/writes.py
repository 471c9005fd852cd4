"""The scheduler's writes to flow runs (:func:`e31.flows.queue.record.apply`
uses them): state and placement writes checked against the runs it planned
with (:class:`RunWriter`), and the lines it adds to the runs' logs
(:class:`RunLogs`)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from e31.flows.queue.announce import announce_placed
from e31.flows.queue.cache import RunCache
from e31.flows.queue.mapping import PLACED, PLACEMENT_PARAM, PlacementRecord, member_nodes, placed_on, placed_tags
from e31.prefect_compat.clock import server_now


class RunLogs:
    """Lines for the flow runs' logs (a run's page in the UI opens on them):
    the queue's word on each run, as it changes.  Collected during a call
    of :func:`e31.flows.queue.record.apply` and sent in one request at its end.  Best effort."""

    def __init__(self, client: Any) -> None:
        self.client, self.lines = client, []

    def add(self, run_id: str, message: str) -> None:
        from prefect.client.schemas.actions import LogCreate

        self.lines.append(LogCreate(name="e31.scheduler", level=20, message=message,
                                    timestamp=datetime.fromtimestamp(server_now(), timezone.utc),
                                    flow_run_id=run_id))

    def send(self) -> None:
        if self.lines:
            try:
                self.client.create_logs(self.lines)
            except Exception:
                pass
            self.lines = []


class RunWriter:
    """The scheduler's writes to flow runs.  With a ``cache`` (runs kept
    between ticks, possibly older than the last change), a run is read again
    first and written only when its state is still the one the plan saw
    (else the fresh run is kept and counted ``stale``: the next tick plans
    with it); each write is recorded in the cache as the server answered
    it.  A run deleted meanwhile is dropped and counted ``gone``."""

    def __init__(self, client: Any, cache: RunCache | None, counts: dict[str, int],
                 work_pool: str | None = None) -> None:
        self.client, self.cache, self.counts, self.work_pool = client, cache, counts, work_pool
        self.nodes: dict[str, str | None] = {}  # run id -> the node :meth:`place` wrote
        self.members: dict[str, tuple[str, ...]] = {}  # run id -> a gang's other nodes :meth:`place` wrote
        self.seen: dict[str, Any] = {}  # run id -> the state id :meth:`current` found
        self.fresh: dict[str, Any] = {}  # run id -> the run as :meth:`current` read it (its tags are the newest)
        self.result: Any = None  # the server's answer to the last state written

    def current(self, key: str) -> bool:
        """Whether the run ``key`` is still as the plan saw it (always, without a cache)."""
        from prefect.exceptions import ObjectNotFound

        if self.cache is None:
            return True
        kept = self.cache.runs.get(key)
        try:
            run = self.client.read_flow_run(key)
        except ObjectNotFound:
            return self._gone(key)
        if kept is not None and kept.state is not None and run.state is not None and kept.state.id == run.state.id:
            self.seen[key], self.fresh[key] = run.state.id, run
            return True
        self.cache.refresh(run)
        self.counts["stale"] += 1
        return False

    def state(self, key: str, state: Any, check: bool = True, force: bool = True) -> bool:
        """Force ``state`` on the run ``key`` (``check``: only when it is
        :meth:`current`; ``force`` False: as Prefect's rules allow, which
        refuse to leave a final state); False when it was not written."""
        from prefect.exceptions import ObjectNotFound

        if check and not self.current(key):
            return False
        try:
            result = self.client.set_flow_run_state(key, state, force=force)
        except ObjectNotFound:
            return self._gone(key)
        self.result = result
        if not force and getattr(getattr(result, "status", None), "value", "ACCEPT") != "ACCEPT":
            if self.cache is not None:
                self.cache.forget(key)  # it ended meanwhile: the next read has it as it is
            return False
        if self.cache is not None:
            self.cache.note_state(key, result, getattr(state.state_details, "scheduled_time", None))
            if state.type.value == "SCHEDULED" and key in self.seen and self._overtaken(key, result):
                return False
        if self.work_pool is not None and state.name == PLACED:  # its worker polls at once
            announce_placed(self.client, self.work_pool, key, self.nodes.get(key), self.members.get(key, ()))
        return True

    def _overtaken(self, key: str, result: Any) -> bool:
        """Undo a write that overtook a final state (a cancel made between
        :meth:`current` and the write: the write is forced, and Prefect lets
        a run leave ``Cancelled`` for ``Scheduled``): that state is set
        again, unless a final state came after the write (the canceller's
        own ``Cancelled``, with its message: left as it is).  True when the
        write was undone (counted ``undone``)."""
        from e31.states import copy_of

        mine = getattr(getattr(result, "state", None), "id", None)
        history = self.client.read_flow_run_states(key)
        index = next((i for i, s in enumerate(history) if s.id == mine), None)
        if not index:
            return False
        if history[-1].id != mine and history[-1].is_final():  # ended again since: not overwritten with the
            self.counts["undone"] += 1  # state before the write, which had no message
            self.cache.forget(key)
            return True
        before = history[index - 1]
        if before.id == self.seen[key] or not before.is_final():
            return False
        again = self.client.set_flow_run_state(key, copy_of(before), force=True)
        self.cache.note_state(key, again)
        self.counts["undone"] += 1
        return True

    def place(self, key: str, run: Any, placement: PlacementRecord, check: bool = True) -> bool:
        """Replace the ``placement`` parameter (:data:`PLACEMENT_PARAM`) of the run ``key`` with the record
        ``placement`` (``run``: as read; its other parameters, which nobody writes after the submission, are sent
        back as they are) (``check``: only when it is :meth:`current`); False when it was not written.  When the
        node it is placed on changes, its :data:`~e31.flows.queue.mapping.PLACED_TAG` goes with it in the same
        update (its other tags as last read: a node's prefetcher writes those).  A plain update (~8 ms of server
        CPU), not a ``job_variables`` write (see there).  A run cancelled meanwhile keeps it, inert: the
        ``Placed`` state that follows is undone (:meth:`_overtaken`)."""
        from prefect.exceptions import ObjectNotFound

        if check and not self.current(key):
            return False
        parameters = {**(run.parameters or {}), PLACEMENT_PARAM: placement.parameter()}
        tags = list(getattr(self.fresh.get(key, run), "tags", None) or [])
        members = tuple(name for name, _ in placement.gang)
        tags = placed_tags(tags, placement.node, members) \
            if (placed_on(tags), member_nodes(tags)) != (placement.node, members) else None
        try:
            if tags is None:
                self.client.update_flow_run(key, parameters=parameters)
            else:
                self.client.update_flow_run(key, parameters=parameters, tags=tags)
        except ObjectNotFound:
            return self._gone(key)
        except Exception as exc:  # the sync client answers with the HTTP error itself
            if getattr(getattr(exc, "response", None), "status_code", None) == 404:
                return self._gone(key)
            raise
        self.nodes[key], self.members[key] = placement.node, members
        if self.cache is not None:
            self.cache.note_placement(key, parameters, tags)
        return True

    def _gone(self, key: str) -> bool:
        if self.cache is not None:
            self.cache.forget(key)
        self.counts["gone"] += 1
        return False
