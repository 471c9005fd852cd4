"""The steps of one attempt at a run, in the order
:class:`e31.flows.attempt.attempt.Attempt` takes them."""

from __future__ import annotations

from enum import Enum


class Step(str, Enum):
    """One step of an attempt.  Its value is the word the run's log uses
    (``attempt step: stage``).

    ``admit``: the spec compiled, the request checked against this machine,
    the destinations checked writable.  ``scratch``: the job's scratch
    folder locked (one attempt of a job per machine) and what a killed
    attempt left cleaned up.  ``deliver pending``: an earlier attempt's
    undelivered output returned first.  ``stage``: every input copied to
    scratch.  ``gates``: what must hold before the work starts (the run
    ahead on this node has ended, the run is still this node's, no cancel,
    time left before the deadline).  ``run``: the supervised work.
    ``return``: the output and manifest delivered.  ``settle``: the
    attempt's end written (scratch cleared after a complete output; a
    failed work raised)."""

    ADMIT = "admit"
    SCRATCH = "scratch"
    DELIVER_PENDING = "deliver pending"
    STAGE = "stage"
    GATES = "gates"
    RUN = "run"
    RETURN = "return"
    SETTLE = "settle"
