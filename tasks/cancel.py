"""Notice a cancel of the flow run made through the Prefect API or UI.

A flow called as a plain Python function is left in ``Cancelling`` by the
API (see ../shared/prefect.md), so the run task polls its flow run's state
itself and stops the work when it sees ``CANCELLING`` or ``CANCELLED``.
"""

from __future__ import annotations

import time

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType

POLL_EVERY_S = 2.0  # seconds between state reads


class CancelWatcher:
    """``cancelled()`` is True once the flow run ``flow_run_id`` is being
    cancelled.  Reads the API at most every :data:`POLL_EVERY_S` seconds; an
    API error counts as "not cancelled" (the run goes on)."""

    def __init__(self, flow_run_id: str | None):
        self.flow_run_id = flow_run_id
        self._next = 0.0
        self._seen = False

    def cancelled(self, force: bool = False) -> bool:
        """True once a cancel was seen; ``force`` reads the API now."""
        if self._seen or self.flow_run_id is None:
            return self._seen
        now = time.monotonic()
        if now < self._next and not force:
            return False
        self._next = now + POLL_EVERY_S
        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(self.flow_run_id).state
        except Exception:
            return False
        self._seen = state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)
        return self._seen
