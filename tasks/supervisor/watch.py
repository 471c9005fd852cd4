"""What the run task's supervisor is told of its flow run while the work runs: :class:`RunWatch`.

The attempt's gates implement it (:class:`e31.flows.attempt.gates.RunGates`); ``tasks`` defines the
protocol so the supervisor never imports ``flows``.  ``warned``, ``peer_failed`` and ``peer_lost`` are optional: the
supervisor asks for them with ``getattr`` (a watch of a single-node run need not have them).
"""

from __future__ import annotations

from typing import NoReturn, Protocol

__all__ = ["RunWatch"]


class RunWatch(Protocol):
    """What the run task is given to learn of its flow run while the work
    runs (the attempt's gates for that time: :class:`e31.flows.attempt.gates.RunGates`).
    None of its reads block; an API error reads as "nothing new"."""

    def cancelled(self) -> bool:
        """True once a cancel of the run was seen: the work is stopped."""
        ...

    def moved_to(self) -> str | None:
        """The other node the run was seen placed on (fenced): the work is
        killed and nothing more is written from here."""
        ...

    def refresh(self, timeout_s: float = 3.0) -> bool:
        """Read the run now (at most ``timeout_s`` seconds); True when it is
        being cancelled."""
        ...

    def preempted(self) -> bool:
        """True once the cancel seen is the queue's preemption (the stop's reason is ``preempted``)."""
        ...

    def checkpoint_durable(self) -> None:
        """A checkpoint of the work has become durable (told at once; never blocks): the queue counts the
        work a preemption throws away from here."""
        ...

    def api_alive(self) -> bool:
        """Whether the Prefect API answered the latest read."""
        ...

    def peer_failed(self) -> tuple[bool, str] | None:
        """While the work runs: ``(lost, why)`` once a peer of a gang's rank has ended with a failure (it
        could not start, its work failed; ``lost``: it was killed), so this rank's work is stopped rather
        than left waiting for it in a collective; None otherwise (optional; never blocks)."""
        ...

    def peer_lost(self) -> str | None:
        """After the work failed: why the try is lost rather than failed, when a peer of a gang's rank
        ended first (killed, or its node gone); None otherwise (optional: a watch without it is never
        lost this way).  May wait a few seconds for the peers to say how they ended."""
        ...

    def warned(self, reason: str) -> None:
        """The work was just warned to stop (``reason``: ``time_limit``, ``cancelled``, ...; told at once,
        never blocks): a gang's lead tells its members (optional: a watch without it is not told)."""
        ...

    def stop(self) -> None:
        """Stop watching."""
        ...

    def step_aside(self, moved: str) -> NoReturn:
        """End this flow process, writing nothing more: the run is ``moved``'s now."""
        ...

    def work_ended(self) -> None:
        """The work ended by itself: a cancel from now on changes nothing."""
        ...
