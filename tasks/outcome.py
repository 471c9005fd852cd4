"""How a run ended: shared by the run and return tasks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from e31.tasks.checkpoint import DurableCheckpoint


@dataclass
class RunOutcome:
    """How the run ended.

    ``reason``: ``finished`` | ``time_limit`` | ``deadline`` | ``cancelled`` |
    ``signal`` | ``crashed`` | ``error`` | ``out_of_memory``.  ``exit_code`` is the child's
    (negative: killed by that signal).  ``checkpoint`` is the newest durable
    checkpoint.  ``run_s`` is the wall time in seconds from child start to
    exit.  ``manifest`` is set when the run task already returned the output
    itself (after a cancel, when Prefect starts no new task).
    ``stop_requested_at``: Unix seconds when the stop warning went out.
    ``stdout_tail`` / ``stderr_tail``: the work's last output lines (masked);
    ``output_lines_dropped``: lines not forwarded to the run's log (rate limit).
    ``peak_memory``: the largest resident memory of the work's process tree
    seen, in bytes (``reason`` ``out_of_memory`` when it passed ``request.memory``).
    ``phases``: in seconds, ``child_start_s`` and ``work_s`` (within
    ``run_s``), ``settle_s`` (after it; see ``e31.tasks.supervisor.report.time_phases``)
    and ``prestart_s`` (the child's loading before the run, :mod:`e31.tasks.supervisor.warm`).
    ``work_started_at``: Unix seconds when the work started (a Python
    entrypoint's function called, a command exec'd; None: it never did),
    where the meter starts (:func:`e31.tasks.meter.meter`); ``released_at``:
    Unix seconds where it stops when the run's process gave up returning
    the output (None: at the return).  ``resumed_from_step``: the step of
    the checkpoint the work was given to resume from (``E31_RESUME_DIR``;
    None: a fresh start).
    """

    reason: str
    exit_code: int | None
    run_s: float
    checkpoint: DurableCheckpoint | None = None
    killed: bool = False
    message: str = ""
    stderr_tail: str = ""
    stdout_tail: str = ""
    output_lines_dropped: int = 0
    peak_memory: int = 0
    stop_requested_at: float | None = None
    uploads: list[DurableCheckpoint] = field(default_factory=list)
    manifest: dict[str, Any] | None = None
    phases: dict[str, float] = field(default_factory=dict)
    work_started_at: float | None = None
    released_at: float | None = None
    resumed_from_step: int | None = None
    #: When this attempt's newest checkpoint became durable (Unix seconds; None: none in this attempt).
    checkpoint_at: float | None = None


class ChildLost(RuntimeError):
    """The child was killed by SIGKILL that E31 did not send (the OOM killer,
    an operator, a lost node): the run may be retried from the newest
    checkpoint.  ``outcome`` describes the lost attempt."""

    def __init__(self, outcome: RunOutcome):
        self.outcome = outcome
        super().__init__(f"work process lost (exit code {outcome.exit_code}); last durable checkpoint: "
                         f"{outcome.checkpoint.step if outcome.checkpoint else 'none'}")
