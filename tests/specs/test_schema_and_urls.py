"""JSON Schema, URL masking, and the import boundary of specs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from e31.specs import json_schema, mask_url
from e31.specs.units import DURATION_PATTERN, MEMORY_PATTERN
from e31.specs.yamlload import load_yaml

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
        "default": 0, "description": "Number of GPUs per node (whole devices).", "minimum": 0, "maximum": 1024,
        "title": "Gpus", "type": "integer",
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
    ("http://svc:P@ssw0rd@127.0.0.1:4200/api", "http://***@127.0.0.1:4200/api"),  # an '@' in the password
    ("https://u:p@host/x@y", "https://***@host/x@y"),
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
    from e31 import specs

    assert sorted(specs.__all__) == sorted([
        "JobSpec", "WorkSpec", "DataInput", "RequestSpec", "OutputSpec", "CheckpointPolicy",
        "SpecError", "Problem", "load_spec", "parse_spec", "json_schema", "parse_duration",
        "parse_memory", "mask_url", "spec_payload", "secrets_in", "is_credential_key", "reference_of",
        "NodeSpec", "PoolSpec", "load_pool", "pool_json_schema",
    ])


def test_modules_stay_small():
    for module in (REPO / "specs").glob("*.py"):
        assert len(module.read_text(encoding="utf-8").splitlines()) <= 300, module.name


def test_query_parameters_named_like_secrets_are_masked():
    from e31.specs import mask_url

    assert mask_url("https://h/x?secret_access_key=abc&region=eu&session_token=t&X-Amz-Signature=s") == (
        "https://h/x?secret_access_key=***&region=eu&session_token=***&X-Amz-Signature=***"
    )


def _job(data_urls: list[str], output_url: str, checkpoint_url: str | None = None) -> str:
    data = ", ".join(f"{{name: d{i}, url: '{url}'}}" for i, url in enumerate(data_urls))
    checkpoint = f", checkpoint: {{url: '{checkpoint_url}'}}" if checkpoint_url else ""
    return (
        "name: job\nwork: {kind: training, entrypoint: a:b}\nrequest: {limit: 1m}\n"
        f"data: [{data}]\noutput: {{kind: results, url: '{output_url}', files: [m.json]{checkpoint}}}\n"
    )


@pytest.mark.parametrize(("data_urls", "output_url", "checkpoint_url"), [
    (["/in/frames"], "/in/frames-out/", "/in/frames.ck"),
    (["/in/frames/"], "file:///in/framesout", None),
    (["s3://b/in/x.csv"], "s3://b/input/", "s3://b/in-ck/"),
    (["s3://b/out/"], "gs://b/out/", "memory://b/out/"),
    (["gs://b/shards/*.parquet"], "gs://b/shards-out/", None),
    (["https://h/data/x.csv?X-Amz-Signature=abc"], "s3://h/data/", None),
    (["simplecache::s3://b/in/x.csv"], "s3://b/out/", None),
    (["/in/a.csv", "s3://b/in/"], "memory://results/job/", "file:///ck/job/"),
])
def test_output_urls_beside_inputs_are_accepted(data_urls, output_url, checkpoint_url):
    from e31.specs import parse_spec

    spec = parse_spec(_job(data_urls, output_url, checkpoint_url))
    assert spec.output.url == output_url and spec.output.checkpoint.url == checkpoint_url


@pytest.mark.parametrize(("data_url", "output_url", "how"), [
    ("/in/frames", "/in/frames/", "the same place as data[0].url"),
    ("file:///in/frames/", "/in//frames", "the same place as data[0].url"),
    ("local:///in/frames", "file:///in/x/../frames/", "the same place as data[0].url"),
    ("s3://b/in", "s3a://b/in/", "the same place as data[0].url"),
    ("simplecache::s3://b/in/", "s3://b/in/sub", "a folder inside data[0].url"),
    ("memory:///in/x.csv", "memory://in", "a folder that holds data[0].url"),
    ("gcs://b/shards/*.parquet", "gs://b/shards", "the same place as data[0].url"),
    ("/srv/in/x.csv", "/srv", "a folder that holds data[0].url"),
])
def test_output_url_overlapping_an_input_is_refused(data_url, output_url, how):
    from e31.specs import SpecError, parse_spec

    with pytest.raises(SpecError) as info:
        parse_spec(_job([data_url], output_url))
    assert [str(p) for p in info.value.problems] == [
        f"output.url: must not overlap an input: the job would write into its own inputs (got {how}); "
        "give output.url a folder of its own, outside every input",
    ]


def test_overlap_through_a_symbolic_link_is_refused(tmp_path):
    from e31.specs import SpecError, parse_spec

    (tmp_path / "d").mkdir()
    (tmp_path / "dlink").symlink_to(tmp_path / "d")
    for data_url, output_url in ((f"{tmp_path}/d/", f"{tmp_path}/dlink/out"), (f"{tmp_path}/dlink/", f"{tmp_path}/d/out")):
        with pytest.raises(SpecError) as info:
            parse_spec(_job([data_url], output_url))
        assert [str(p) for p in info.value.problems] == [
            "output.url: must not overlap an input: the job would write into its own inputs (got a folder inside "
            "data[0].url); give output.url a folder of its own, outside every input"]


def test_relative_output_and_inputs_compare_against_the_same_folder(tmp_path):
    from e31.specs import SpecError, load_spec

    path = tmp_path / "job.yaml"
    path.write_text(_job(["data/frames/"], "data"), encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert [p.path for p in info.value.problems] == ["output.url"]
    assert "(got a folder that holds data[0].url)" in info.value.problems[0].message


def test_masked_output_urls_validate_again():
    from e31.specs import JobSpec, parse_spec, spec_payload

    spec = parse_spec(_job(["s3://tok@b/in/"], "s3://tok@b/out/", "s3://tok@b/ck/"))
    masked = spec_payload(spec, reveal=False)
    assert masked["output"]["url"] == "s3://***@b/out/"
    assert JobSpec.model_validate(masked).output.checkpoint.url == "s3://***@b/ck/"


def test_output_url_rules_apply_to_models_built_in_python():
    from e31.specs import DataInput, JobSpec, OutputSpec, RequestSpec, SpecError, WorkSpec

    with pytest.raises(SpecError) as info:
        JobSpec(name="j", work=WorkSpec(kind="processing", command=["x"]), request=RequestSpec(limit=60),
                data=[DataInput(name="d", url="/in/d/")], output=OutputSpec(kind="files", url="/in/d/out", files=["f"]))
    assert [p.path for p in info.value.problems] == ["output.url"]
    with pytest.raises(SpecError) as info:
        OutputSpec(kind="files", url="s3://", files=["f"])
    assert [p.path for p in info.value.problems] == ["url"]


@pytest.mark.parametrize("url", [
    "s3://bucket/key", "s3://KEY:SECRET@bucket/x", "s3://KEY:SEC/RET@bucket/x", "https://token@host/x",
    "https://h/x.csv?X-Amz-Signature=abc&X-Amz-Credential=AK", "https://h/x?sig=1", "https://h/x?Key=1",
    "https://h/x?keyword=1", "https://h/x?secret_access_key=z", "https://h/x?page=2", "/local/path",
    "file:///a/b", "simplecache::s3://K:S@b/x", "https://h:8080/p@x", "gs://b/shards/*.parquet",
    "https://h/x?a=1&Signature=2", "https://host/path?sig", "http://h:80/a?b=c",
])
def test_schema_secret_url_pattern_agrees_with_mask_url(url):
    """The JSON Schema refuses (so a Prefect server does not store) exactly
    the URLs mask_url would hide something in."""
    import re

    from e31.specs.urls import SECRET_URL_PATTERN, mask_url

    assert bool(re.search(SECRET_URL_PATTERN, url)) is (mask_url(url) != url)
