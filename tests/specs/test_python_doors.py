"""One mistake, one error: a spec or pool built from Python (``JobSpec(...)``,
``JobSpec.model_validate``, ``model_validate_json``, ``PoolSpec``) raises the
same :class:`SpecError`, worded line for line, as loading it from a file does.
Nested in another pydantic model (a Prefect flow parameter) the error stays
pydantic's ValidationError, which Prefect turns into a failed flow run."""

from __future__ import annotations

import json
import pickle

import pytest
from pydantic import BaseModel, ValidationError

from e31.errors import EXIT_INVALID, E31Error
from e31.specs import JobSpec, PoolSpec, SpecError, WorkSpec, load_pool, load_spec, parse_spec
from e31.specs.pool import parse_pool

BAD_SPEC = {
    "name": "j", "work": {"kind": "processing", "command": ["x"]}, "request": {"gpus": -1, "limit": "1m"},
    "output": {"kind": "results", "url": "/srv/results/j/", "files": ["x"]}, "dataa": [],
}
BAD_SPEC_TEXT = (
    "invalid job spec <spec> (2 problems)\n"
    "  request.gpus: must be >= 0 (got -1)\n"
    "  dataa: unknown field; did you mean 'data'?"
)
BAD_POOL = {"pool_version": 2, "nodes": [{"name": "a", "cpus": 0, "memory": "1GiB"}]}
BAD_POOL_TEXT = (
    "invalid pool <pool> (2 problems)\n"
    "  pool_version: must be 1 (got 2)\n"
    "  nodes[0].cpus: must be >= 1 (got 0)"
)


def _error(make) -> SpecError:
    with pytest.raises(SpecError) as info:
        make()
    return info.value


@pytest.mark.parametrize("door", ["model_validate", "init", "model_validate_json", "model_validate_strings"])
def test_every_python_door_raises_the_loaders_spec_error_word_for_word(door):
    make = {
        "model_validate": lambda: JobSpec.model_validate(BAD_SPEC),
        "init": lambda: JobSpec(**BAD_SPEC),
        "model_validate_json": lambda: JobSpec.model_validate_json(json.dumps(BAD_SPEC)),
        "model_validate_strings": lambda: JobSpec.model_validate_strings(BAD_SPEC),
    }[door]
    err = _error(make)
    assert type(err) is SpecError and str(err) == BAD_SPEC_TEXT
    assert str(err) == str(_error(lambda: parse_spec(BAD_SPEC)))
    assert err.__cause__ is None and err.__suppress_context__  # no pydantic traceback chained to it


def test_the_file_door_lists_the_same_problems(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(BAD_SPEC))
    from_file = _error(lambda: load_spec(path))
    assert str(from_file) == BAD_SPEC_TEXT.replace("<spec>", str(path))
    assert from_file.problems == _error(lambda: JobSpec.model_validate(BAD_SPEC)).problems


def test_the_pool_model_raises_the_pool_loaders_error(tmp_path):
    assert str(_error(lambda: PoolSpec.model_validate(BAD_POOL))) == BAD_POOL_TEXT
    assert str(_error(lambda: PoolSpec(**BAD_POOL))) == BAD_POOL_TEXT
    assert str(_error(lambda: parse_pool(BAD_POOL))) == BAD_POOL_TEXT
    path = tmp_path / "pool.json"
    path.write_text(json.dumps(BAD_POOL))
    assert str(_error(lambda: load_pool(path))) == BAD_POOL_TEXT.replace("<pool>", str(path))


def test_a_part_of_a_spec_names_its_paths_from_itself():
    err = _error(lambda: WorkSpec(kind="service", command="python x.py"))
    assert err.source == "<WorkSpec>" and [p.path for p in err.problems] == ["kind", "command"]
    assert str(err).startswith("invalid job spec <WorkSpec> (2 problems)\n  kind: live work is refused")
    assert err.problems[1].message == "must be a list of program and arguments (got 'python x.py'); write it as a " \
                                      "list, e.g. [python, x.py]"


def test_the_error_is_e31s_bad_input_error_and_survives_pickling():
    err = _error(lambda: JobSpec.model_validate(BAD_SPEC))
    assert isinstance(err, E31Error) and isinstance(err, ValueError) and err.exit_code == EXIT_INVALID
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is SpecError and str(again) == BAD_SPEC_TEXT and again.problems == err.problems


def test_a_valid_spec_is_built_by_every_door():
    good = {**BAD_SPEC, "request": {"limit": "1m"}}
    del good["dataa"]
    spec = JobSpec.model_validate(good)
    assert JobSpec(**good) == spec == JobSpec.model_validate_json(json.dumps(good)) == parse_spec(good)


def test_nested_in_another_model_the_error_stays_pydantics():
    """Prefect validates flow parameters as fields of a pydantic model and
    catches ValidationError: a spec nested there must not raise SpecError."""

    class Parameters(BaseModel):
        spec: JobSpec

    with pytest.raises(ValidationError) as info:
        Parameters(spec=BAD_SPEC)
    assert [e["loc"] for e in info.value.errors()] == [("spec", "request", "gpus"), ("spec", "dataa")]
    good = {key: value for key, value in BAD_SPEC.items() if key != "dataa"} | {"request": {"limit": "1m"}}
    assert Parameters(spec=good).spec == JobSpec.model_validate(good)
