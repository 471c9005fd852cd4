"""The attempt's current step as a label of its flow run (``e31.step``),
which ``e31 queue`` shows for a running run
(:func:`e31.deployments.runwords.holding`).

Written only on a queue's node (``E31_NODE`` set: :func:`e31.tasks.supervisor.fence.this_node`),
for the steps that take time, from a thread of its own: a slow or absent
Prefect API never delays the attempt, and a step overtaken by the next
before it was written is skipped.  Prefect merges labels (``PATCH
/flow_runs/{id}/labels``), so the label never replaces the scheduler's
tags or parameters.
"""

from __future__ import annotations

import threading

from e31.flows.attempt.steps import Step
from e31.tasks.supervisor.fence import this_node

#: The flow run label that names the attempt's step.
STEP_LABEL = "e31.step"

#: The steps written as the label (the others take no noticeable time).
SHOWN = (Step.STAGE, Step.GATES, Step.RUN, Step.RETURN)


class StepLabel:
    """Keeps the ``e31.step`` label of the flow run ``run_id`` at the
    latest step given to :meth:`show`; best effort (an API error drops
    that write)."""

    def __init__(self, run_id: str | None):
        self.run_id = run_id
        self.written: str | None = None
        self._want: str | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def show(self, step: Step) -> None:
        """Ask for ``step`` to be written (returns at once)."""
        if self.run_id is None or step not in SHOWN or this_node() is None:
            return
        with self._cond:
            self._want = step.value
            self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="e31-step-label", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            while True:
                with self._cond:
                    while self._want == self.written:
                        self._cond.wait()
                    value = self._want
                try:
                    client.update_flow_run_labels(self.run_id, {STEP_LABEL: value})
                except Exception:  # the label is a courtesy: the queue shows "running" without it
                    pass
                self.written = value
