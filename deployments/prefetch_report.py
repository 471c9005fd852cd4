"""What a prefetch (:mod:`e31.deployments.prefetch`) tells while it runs:
its progress artifact on the flow run (which ``e31 queue`` reads back with
:func:`progress_of`), and the watch of whether the run is still queued."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from e31.deployments.prefetch import Gate

#: Seconds between progress artifact updates, and between checks of the run's state while copying.
REPORT_EVERY_S = 2.0
#: Text of the progress artifact's description (and of ``e31 queue``'s column) starts with this.
PROGRESS_PREFIX = "inputs "


def _size(n: float) -> str:
    from e31.tasks.storage.progress import human_bytes

    return human_bytes(n)


class _Watch:
    """Whether the flow run is still queued: read every :data:`REPORT_EVERY_S`
    seconds from a thread of its own (never from a transfer's thread)."""

    def __init__(self, run_id: str) -> None:
        self.run_id, self._ok, self._closed = run_id, True, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="e31-prefetch-watch")
        self._thread.start()

    def _read(self) -> None:
        from prefect.client.orchestration import get_client

        from e31.flows.queue import QUEUED

        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(self.run_id).state
            self._ok = state is not None and state.type.value == "SCHEDULED" and state.name == QUEUED
        except Exception as exc:
            if type(exc).__name__ == "ObjectNotFound":
                self._ok = False

    def _loop(self) -> None:
        while not self._closed.wait(REPORT_EVERY_S):
            self._read()

    def ok(self, fresh: bool = False) -> bool:
        if fresh:
            self._read()
        return self._ok

    def close(self) -> None:
        self._closed.set()


class _Progress:
    """The prefetch's progress artifact on the flow run, written every
    :data:`REPORT_EVERY_S` seconds from a thread of its own (best effort)."""

    def __init__(self, run_id: str, node: str, total: int, already: int) -> None:
        self.run_id, self.node, self.total = run_id, node, total
        self.base = already  # bytes of inputs already staged, and of inputs finished since
        self.gate: "Gate | None" = None
        self.artifact_id = None
        self._closed = threading.Event()

    def text(self, done: int, tail: str = "") -> str:
        return f"{PROGRESS_PREFIX}{_size(done)} of {_size(self.total)} staged on {self.node}{tail}"

    def _write(self, done: int, tail: str = "") -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

        percent = min(100.0, 100.0 * done / self.total) if self.total else 100.0
        try:
            with get_client(sync_client=True) as client:
                if self.artifact_id is None:
                    self.artifact_id = client.create_artifact(ArtifactCreate(
                        type="progress", data=percent, description=self.text(done, tail),
                        flow_run_id=self.run_id)).id
                else:
                    client.update_artifact(self.artifact_id, ArtifactUpdate(data=percent,
                                                                            description=self.text(done, tail)))
        except Exception:
            pass

    def running(self, gate: "Gate") -> "_Progress":
        self.gate = gate
        return self

    def __enter__(self) -> "_Progress":
        self._write(self.base)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="e31-prefetch-progress")
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._closed.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._closed.wait(REPORT_EVERY_S):
            self._write(self.base + (self.gate.done if self.gate else 0))

    def finished(self, name: str, nbytes: int) -> None:
        """The input ``name`` (``nbytes``) is staged."""
        self.base += nbytes
        if self.gate is not None:
            self.gate.done = 0

    def said(self, text: str) -> None:
        """Put ``text`` as the artifact's description (at 0%)."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactCreate

        try:
            with get_client(sync_client=True) as client:
                client.create_artifact(ArtifactCreate(type="progress", data=0.0, description=text,
                                                      flow_run_id=self.run_id))
        except Exception:
            pass

    def done(self, seconds: float) -> None:
        """Every input is staged, in ``seconds``."""
        self._write(self.total, f" before allocation, in {seconds:.1f} s")


def progress_of(client: Any, run_ids: list[str]) -> dict[str, str]:
    """Flow run id -> the latest prefetch progress text of each run in
    ``run_ids`` that has one ("inputs 3.2 GiB of 10.0 GiB staged on n2")."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType
    from prefect.client.schemas.sorting import ArtifactSort

    if not run_ids:
        return {}
    found: dict[str, str] = {}
    for artifact in client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=run_ids),
                                           type=ArtifactFilterType(any_=["progress"])),
            sort=ArtifactSort.UPDATED_DESC, limit=len(run_ids) * 4 + 20):
        key, text = str(artifact.flow_run_id), artifact.description or ""
        if text.startswith(PROGRESS_PREFIX) and key not in found:
            found[key] = text
    return found
