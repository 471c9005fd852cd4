"""One attempt at one run of a job: its steps (:class:`Step`), the gates
its work starts under (:mod:`e31.flows.attempt.gates`), its fencing and
token (:mod:`e31.flows.attempt.fencing`), and what its end makes of the
flow run (:func:`run_in_flow`).  ``run_job`` (:mod:`e31.flows.job`) is a
thin wrapper of :func:`run_in_flow`."""

from e31.flows.attempt.attempt import DELIVERED, ON_DELIVERED, Attempt
from e31.flows.attempt.errors import JobFailedError, ReturnError
from e31.flows.attempt.flowrun import run_in_flow
from e31.flows.attempt.steps import Step

__all__ = ["Attempt", "DELIVERED", "JobFailedError", "ON_DELIVERED", "ReturnError", "Step", "run_in_flow"]
