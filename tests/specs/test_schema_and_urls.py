"""JSON Schema, URL masking, and the import boundary of specs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specs import json_schema, mask_url
from specs.units import DURATION_PATTERN, MEMORY_PATTERN
from specs.yamlload import load_yaml

jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "specs" / "examples" / "digits-nightly-retrain.yaml"


def example_data() -> dict:
    data, problems = load_yaml(EXAMPLE.read_text(encoding="utf-8"), str(EXAMPLE))
    assert problems == []
    return data


def test_schema_is_draft_2020_12_and_valid():
    schema = json_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"] == "E31 job spec"
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["required"] == ["name", "work", "request", "output"]
    assert schema["additionalProperties"] is False


def test_example_validates_against_schema():
    jsonschema.Draft202012Validator(json_schema()).validate(example_data())


def test_schema_field_forms():
    defs = json_schema()["$defs"]
    request = defs["RequestSpec"]["properties"]
    duration = {"type": "string", "pattern": DURATION_PATTERN}
    assert request["duration"]["anyOf"] == [duration, {"type": "number", "minimum": 0}, {"type": "null"}]
    assert request["limit"]["anyOf"] == [duration, {"type": "number", "minimum": 0}, {"type": "null"}]
    assert request["grace"]["anyOf"] == [duration, {"type": "number", "minimum": 0}]
    assert request["memory"]["anyOf"] == [
        {"type": "string", "pattern": MEMORY_PATTERN}, {"type": "integer", "minimum": 1}, {"type": "null"},
    ]
    deadline = request["deadline"]["anyOf"][0]
    assert deadline["type"] == "string" and deadline["format"] == "date-time"
    assert request["gpus"] == {
        "default": 0, "description": "Number of GPUs.", "minimum": 0, "title": "Gpus", "type": "integer",
    }
    assert defs["WorkSpec"]["properties"]["kind"]["enum"] == ["training", "inference", "processing", "simulation"]
    assert defs["OutputSpec"]["properties"]["kind"]["enum"] == ["model", "results", "files", "report"]


def test_every_field_has_title_and_description():
    schema = json_schema()
    models = [schema, *schema["$defs"].values()]
    for model in models:
        for name, prop in model["properties"].items():
            assert prop.get("title") and prop.get("description"), name


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("request", "duration"), "soon"),
        (("request", "memory"), "4 gigs"),
        (("request", "deadline"), "2026-11-30T06:00:00"),
        (("request", "gpus"), -1),
        (("work", "kind"), "service"),
        (("work", "port"), 8080),
        (("name",), "bad name"),
    ],
)
def test_schema_refuses_bad_values(path, value):
    data = example_data()
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert not jsonschema.Draft202012Validator(json_schema()).is_valid(data)


MASKS = [
    ("s3://KEY:SECRET@bucket/x", "s3://***@bucket/x"),
    ("https://user:pw@host/p", "https://***@host/p"),
    ("https://token@github.com/org/repo.git", "https://***@github.com/org/repo.git"),
    ("s3://AKIA:abc/def+ghi@bucket/key", "s3://***@bucket/key"),
    ("https://host:8080/users/@me", "https://host:8080/users/@me"),
    ("https://host/p?X-Amz-Signature=abc&X-Amz-Credential=AK%2F1&X-Amz-Expires=60",
     "https://host/p?X-Amz-Signature=***&X-Amz-Credential=***&X-Amz-Expires=60"),
    ("https://acct.blob.core.windows.net/c/b?sv=2020&sig=ABC%3D", "https://acct.blob.core.windows.net/c/b?sv=2020&sig=***"),
    ("https://h/p?SIGNATURE=1&Token=2&access_token=3&key=4&secret=5&password=6&page=7#frag",
     "https://h/p?SIGNATURE=***&Token=***&access_token=***&key=***&secret=***&password=***&page=7#frag"),
    ("simplecache::s3://K:S@bucket/x", "simplecache::s3://***@bucket/x"),
    ("/data/digits.csv.gz", "/data/digits.csv.gz"),
    ("data/x@y.csv", "data/x@y.csv"),
    ("s3://bucket/plain/key", "s3://bucket/plain/key"),
    ("", ""),
]


@pytest.mark.parametrize(("url", "masked"), MASKS)
def test_mask_url(url, masked):
    assert mask_url(url) == masked


def test_specs_imports_only_stdlib_pydantic_and_yaml():
    code = (
        "import sys, specs\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('prefect', 'fsspec', 'torch', 'tasks', 'flows', 'deployments', 'examples', 'numpy', 'rich')]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_interface():
    import specs

    assert sorted(specs.__all__) == sorted([
        "JobSpec", "WorkSpec", "DataInput", "RequestSpec", "OutputSpec", "CheckpointPolicy",
        "SpecError", "Problem", "load_spec", "parse_spec", "json_schema", "parse_duration",
        "parse_memory", "mask_url", "spec_payload", "secrets_in", "is_credential_key", "reference_of",
    ])


def test_modules_stay_small():
    for module in (REPO / "specs").glob("*.py"):
        assert len(module.read_text(encoding="utf-8").splitlines()) <= 300, module.name


def test_query_parameters_named_like_secrets_are_masked():
    from specs import mask_url

    assert mask_url("https://h/x?secret_access_key=abc&region=eu&session_token=t&X-Amz-Signature=s") == (
        "https://h/x?secret_access_key=***&region=eu&session_token=***&X-Amz-Signature=***"
    )
