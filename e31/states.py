"""The one place E31 builds Prefect states.

Every state E31 writes on a flow run -- the queue's ``Queued`` and
``Placed``, a worker's ``Returning``, a refusal, a cancel, a crash, a
manifest's verdict -- is built by a function here, so its type, name and
message have one definition.  Callers still choose when to write it and how
(``force``, checks); they never call a Prefect state constructor themselves
(``tests/test_states_module.py`` fails when one does).

:func:`manifest_state` is the one map from a manifest's verdict to a state;
:func:`for_manifest` builds that state.

Prefect is imported inside the builders, so importing the names
(:data:`QUEUED`, :data:`PLACED`, :data:`RETURNING`) stays quick.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

#: The name of a waiting run's ``Scheduled`` state (the queue writes it).
QUEUED = "Queued"
#: The name of a placed run's ``Scheduled`` state (its node's worker takes it).
PLACED = "Placed"
#: The name of the ``Pending`` state a worker holds a run in while it finishes a return its flow process cut.
RETURNING = "Returning"
#: The name of the ``Completed`` state of a run that stopped early and returned what it had.
PARTIAL = "Partial"
#: The name of the ``Cancelling`` state the queue writes on a run it preempts (:mod:`e31.flows.queue.preempt`):
#: its events are ``prefect.flow-run.Preempting``, which Prefect's own cancellation observer does not follow, so
#: the flow process stops its work and returns its output itself (its ``e31 worker`` sends it SIGTERM at once).
PREEMPTING = "Preempting"
#: The name of the ``Cancelled`` state a preempted run ends in, once its output is returned; the next tick of
#: the scheduler queues it again (``Queued``), as the same job, with none of its retries used.
PREEMPTED = "Preempted"
#: The name of the ``Cancelled`` state of a run refused because its job is held by another run.
REFUSED = "Refused"


def queued(message: str, scheduled_time: datetime) -> Any:
    """``Scheduled`` named :data:`QUEUED`: a run waiting in the queue, planned for ``scheduled_time``."""
    from prefect.states import Scheduled

    return Scheduled(name=QUEUED, scheduled_time=scheduled_time, message=message)


def placed(message: str, scheduled_time: datetime) -> Any:
    """``Scheduled`` named :data:`PLACED`: a run placed on a node, to start at ``scheduled_time``."""
    from prefect.states import Scheduled

    return Scheduled(name=PLACED, scheduled_time=scheduled_time, message=message)


def returning(message: str) -> Any:
    """``Pending`` named :data:`RETURNING`: a worker finishes the return its run's flow process cut
    (``Pending``, not ``Running``: entering ``Running`` counts as an attempt in Prefect's ``run_count``)."""
    from prefect.states import Pending

    return Pending(name=RETURNING, message=message)


def refused(why: str) -> Any:
    """``Failed`` with message ``"refused: <why>"``: the queue refuses a run (it can never be placed, its
    spec is bad, or it crashed too often before its work started)."""
    from prefect.states import Failed

    return Failed(message=f"refused: {why}")


def refused_busy(why: str, data: Any = None) -> Any:
    """``Cancelled`` named :data:`REFUSED` with message ``"refused: <why>"``: a run that found its job held
    by another run (not a failure: it never ran); ``data``: what a caller of the flow gets raised."""
    from prefect.states import Cancelled

    return Cancelled(name=REFUSED, message=f"refused: {why}", data=data)


def cancelled(message: str) -> Any:
    """``Cancelled`` (named ``Cancelled``) with ``message``."""
    from prefect.states import Cancelled

    return Cancelled(message=message)


def cancelling(message: str) -> Any:
    """``Cancelling`` with ``message``: a cancel requested of a run that may be running."""
    from prefect.states import Cancelling

    return Cancelling(message=message)


def preempting(message: str) -> Any:
    """``Cancelling`` named :data:`PREEMPTING` with ``message``: the queue stops a run for a job with priority
    over it."""
    from prefect.states import Cancelling

    return Cancelling(name=PREEMPTING, message=message)


def preempted(message: str, data: Any = None) -> Any:
    """``Cancelled`` named :data:`PREEMPTED` with ``message`` (and ``data``: the run's manifest): a preempted
    run that returned its output; the queue takes it back."""
    from prefect.states import Cancelled

    return Cancelled(name=PREEMPTED, message=message, data=data)


def crashed(message: str) -> Any:
    """``Crashed`` with ``message``: a run whose process is gone."""
    from prefect.states import Crashed

    return Crashed(message=message)


def failed(message: str, data: Any = None) -> Any:
    """``Failed`` with ``message`` (and ``data``: what a caller of the flow gets raised)."""
    from prefect.states import Failed

    return Failed(message=message, data=data)


def partial(message: str, data: Any = None) -> Any:
    """``Completed`` named :data:`PARTIAL` with ``message`` (and ``data``: the run's manifest)."""
    from prefect.states import Completed

    return Completed(name=PARTIAL, message=message, data=data)


def copy_of(state: Any) -> Any:
    """A new state with ``state``'s type, name and message (nothing else: no data, no time), to set a
    run back to a state it had."""
    from prefect.states import State

    return State(type=state.type, name=state.name, message=state.message)


def manifest_state(manifest: Any) -> dict[str, str]:
    """The one map from a manifest's verdict to the state its run ends in, as ``type``, ``name`` and
    ``message`` (a JSON-able dict, so it can be recorded and set later): ``completed`` -> Completed;
    ``partial`` with reason ``cancelled`` -> Cancelled; with reason ``preempted`` -> Cancelled named
    :data:`PREEMPTED`; another ``partial`` -> Completed named
    :data:`PARTIAL`, message ``"partial (<reason>): <message>"``; ``failed`` -> Failed.  The message is
    the manifest's, or ``"<status> (<reason>)"`` without one.  ``manifest``: a manifest's dict, or the part
    of one with ``status``, ``reason`` and ``message`` (:class:`e31.tasks.manifest_model.ManifestHead`)."""
    from e31.tasks.manifest_model import ManifestHead  # here: e31.states is imported by lower layers too

    head = ManifestHead.of(manifest)
    status, reason = head.status, head.reason
    message = head.message or f"{status} ({reason})"
    if status == "completed":
        return {"type": "COMPLETED", "name": "Completed", "message": message}
    if status == "partial" and reason == "cancelled":
        return {"type": "CANCELLED", "name": "Cancelled", "message": message}
    if status == "partial" and reason == "preempted":
        return {"type": "CANCELLED", "name": PREEMPTED, "message": message}
    if status == "partial":
        return {"type": "COMPLETED", "name": PARTIAL, "message": f"partial ({reason}): {message}"}
    return {"type": "FAILED", "name": "Failed", "message": message}


def from_record(record: dict[str, str]) -> Any:
    """The state a :func:`manifest_state` dict (or a record holding its ``type``, ``name`` and ``message``)
    describes."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import State

    return State(type=StateType(record["type"]), name=record["name"], message=record["message"])


def for_manifest(manifest: Any) -> Any:
    """The state a run whose manifest is ``manifest`` ends in (:func:`manifest_state`)."""
    return from_record(manifest_state(manifest))
