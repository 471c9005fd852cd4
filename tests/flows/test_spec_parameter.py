"""A flow run given a bad ``spec`` parameter fails with the field and what is
wrong (Prefect validates flow parameters with pydantic and catches its
ValidationError; a spec built from Python raises E31's SpecError instead,
which must not reach Prefect's parameter check)."""

from __future__ import annotations

from e31.flows.job import run_job

BAD = {"name": "j", "work": {"kind": "processing", "command": ["x"]}, "request": {"gpus": -1, "limit": "1m"},
       "output": {"kind": "results", "url": "/srv/results/j/", "files": ["x"]}}


def test_a_flow_run_with_a_bad_spec_parameter_fails_naming_the_field(prefect_api, scratch):
    state = run_job(BAD, return_state=True)
    assert state.type.value == "FAILED"
    assert state.message == ("Validation of flow parameters failed with error: ParameterTypeError: Flow run received "
                             "invalid parameters:\n - spec.request.gpus: Input should be greater than or equal to 0")
