"""Loading: the example, YAML traps, overrides, relative paths, JSON files and round trips."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from e31.specs import (
    CheckpointPolicy, DataInput, JobSpec, OutputSpec, Problem, RequestSpec, SpecError, WorkSpec,
    load_spec, parse_duration, parse_spec,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "specs" / "examples" / "digits-nightly-retrain.yaml"

MINIMAL = """\
name: job
work: {kind: training, entrypoint: pkg.mod:main}
request: {limit: 30m}
output: {kind: results, url: /out/job/, files: [metrics.json]}
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def example_duration() -> timedelta:
    """The example's expected run time as written in the file (others tune it)."""
    import re

    text = EXAMPLE.read_text(encoding="utf-8")
    return parse_duration(re.search(r"^  duration: (\S+)", text, re.M).group(1))


def test_example_loads_with_exact_values():
    spec = load_spec(EXAMPLE)
    examples = REPO / "specs" / "examples"
    assert spec == JobSpec(
        spec_version=1,
        name="digits-nightly-retrain",
        work=WorkSpec(
            kind="training",
            entrypoint="e31.examples.digits:train",
            params={"epochs": 30, "hidden": 64, "lr": 0.01, "batch_size": 64, "seed": 0, "holdout": 0.2},
        ),
        data=[DataInput(
            name="digits",
            url=str(examples / "data" / "digits.csv.gz"),
            sha256="09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22",
        )],
        request=RequestSpec(gpus=0, cpus=1, memory=2 * 1024**3, duration=example_duration(),
                            limit=timedelta(minutes=10)),
        output=OutputSpec(
            kind="model",
            url=str(examples / "results" / "digits-nightly-retrain") + "/",
            files=["model.pt", "metrics.json"],
            checkpoint=CheckpointPolicy(every_steps=1, keep=3),
        ),
    )
    assert spec.request.grace == timedelta(seconds=10)
    assert spec.request.retries == 0
    assert Path(spec.data[0].url).is_file()


def test_example_json_round_trip():
    spec = load_spec(EXAMPLE)
    dumped = spec.model_dump(mode="json")
    assert dumped["request"] == {
        "nodes": 1, "gpus": 0, "gpu_type": None, "cpus": 1, "memory": 2147483648, "duration": dumped["request"]["duration"],
        "limit": "PT10M", "deadline": None, "deadline_within": None, "deadline_at": None, "grace": "PT10S", "retries": 0,
        "preemptible": None,
    }
    assert parse_duration(dumped["request"]["duration"]) == example_duration()
    assert JobSpec.model_validate(dumped) == spec


def test_round_trip_with_every_field(tmp_path):
    spec = parse_spec(MINIMAL.replace(
        "request: {limit: 30m}",
        "request: {gpus: 2, cpus: 8, memory: 1.5GB, duration: 1d2h3m4.5s, limit: P300D, "
        "deadline: '2999-01-02T03:04:05+02:00', grace: 0s, retries: 2}",
    ).replace("files: [metrics.json]", "files: [metrics.json], checkpoint: {every: 90s, keep: 1, url: s3://b/ck/}"))
    dumped = spec.model_dump(mode="json")
    assert dumped["request"]["duration"] == "P1DT2H3M4.5S"
    assert dumped["request"]["limit"] == "P300D"
    assert dumped["request"]["deadline"] == "2999-01-02T03:04:05+02:00"
    assert dumped["request"]["grace"] == "PT0S"
    assert dumped["output"]["checkpoint"]["every"] == "PT1M30S"
    again = JobSpec.model_validate(dumped)
    assert again == spec
    assert again.request.deadline == datetime(2999, 1, 2, 1, 4, 5, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    ("line", "field", "expected"),
    [
        ("duration: 4:00:00", "duration", timedelta(hours=4)),
        ('duration: "04:00:00"', "duration", timedelta(hours=4)),
        ("duration: 4h", "duration", timedelta(hours=4)),
        ("duration: 1:30", "duration", timedelta(seconds=90)),
        ("duration: 90", "duration", timedelta(seconds=90)),
        ("duration: PT4H", "duration", timedelta(hours=4)),
        ("memory: 2GiB", "memory", 2 * 1024**3),
        ("memory: 1024", "memory", 1024),
    ],
)
def test_yaml_durations_and_sizes(line, field, expected):
    spec = parse_spec(MINIMAL.replace("request: {limit: 30m}", f"request:\n  limit: 30d\n  {line}"))
    assert getattr(spec.request, field) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [("NO", "NO"), ("no", "no"), ("yes", "yes"), ("on", "on"), ("off", "off"), ("y", "y"),
     ("2024", "2024"), ("1.5", "1.5"), ("2024-01-01", "2024-01-01"), ("'007'", "007")],
)
def test_string_fields_keep_yaml_11_trap_values(value, expected):
    spec = parse_spec(MINIMAL.replace("name: job", f"name: {value}"))
    assert spec.name == expected


def test_params_keep_their_yaml_12_types():
    spec = parse_spec(MINIMAL.replace(
        "entrypoint: pkg.mod:main}",
        "entrypoint: pkg.mod:main, params: {country: NO, flag: yes, sw: on, t: true, f: FALSE, n: ~, "
        "e: null, d: 2024-01-01, clock: 1:30, dec: 010, oct: 0o17, hex: 0x1F, fl: 1e3, "
        "v: 1.10, s: '3'}}",
    ))
    assert spec.work.params == {
        "country": "NO", "flag": "yes", "sw": "on", "t": True, "f": False, "n": None, "e": None,
        "d": "2024-01-01", "clock": "1:30", "dec": 10, "oct": 15, "hex": 31, "fl": 1000.0,
        "v": 1.1, "s": "3",
    }


def test_command_numbers_become_strings():
    spec = parse_spec(MINIMAL.replace("entrypoint: pkg.mod:main", "command: [python, train.py, --epochs, 20]"))
    assert spec.work.command == ["python", "train.py", "--epochs", "20"]
    assert spec.work.entrypoint is None


def test_sha256_is_lower_cased():
    spec = parse_spec(MINIMAL + "data: [{name: d, url: /d.csv, sha256: " + "AB" * 32 + "}]\n")
    assert spec.data[0].sha256 == "ab" * 32


def test_overrides_apply_in_order(tmp_path, monkeypatch):
    path = write(tmp_path, MINIMAL + "data: [{name: d, url: in.csv}]\n")
    monkeypatch.chdir(tmp_path)
    spec = load_spec(path, [
        "request.limit=20s",
        "request.memory=512MB",
        "work.params.epochs=3",
        "work.params.opt.name=adam",
        "data[0].url=s3://bucket/x.csv",
        "data.0.sha256=" + "Ab" * 32,
        "output.files=[a.pt, b.json]",
        "name=NO",
    ])
    assert spec.request.limit == timedelta(seconds=20)
    assert spec.request.memory == 512_000_000
    assert spec.work.params == {"epochs": 3, "opt": {"name": "adam"}}
    assert spec.data[0].url == "s3://bucket/x.csv"
    assert spec.data[0].sha256 == "ab" * 32
    assert spec.output.files == ["a.pt", "b.json"]
    assert spec.name == "NO"


def test_override_value_can_make_spec_invalid(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(SpecError) as info:
        load_spec(path, ["request.gpus=-2"])
    assert str(info.value) == f"invalid job spec {path} (1 problem)\n  request.gpus: must be >= 0 (got -2)"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("request.limit", "expected DOTTED.PATH=VALUE, e.g. request.limit=20s (got 'request.limit')"),
        ("=3", "the path before '=' is empty"),
        ("a..b=1", "malformed path segment ''; use names and [N] indexes, e.g. data[0].url"),
        ("data[x].url=1", "list index [x] must be a whole number >= 0"),
        ("data[3].url=x", "index 3 is out of range: data has 1 item(s)"),
        ("data.name=x", "data is a list; index it with a number, e.g. data[0]"),
        ("name.first=x", "name is a str, not a mapping or list"),
        ("request[0]=x", "request is a mapping, not a list; [0] cannot index it"),
        ("output.files[7]=x", "index 7 is out of range: output.files has 1 item(s)"),
        ("work.params.list[0]=x", "index 0 is out of range: work.params.list has no items"),
        ("request.limit=[1", "the value is not valid YAML (got '[1'); expected ',' or ']', but got '<stream end>'"),
    ],
)
def test_malformed_overrides(tmp_path, override, message):
    path = write(tmp_path, MINIMAL + "data: [{name: d, url: /in.csv}]\n")
    with pytest.raises(SpecError) as info:
        load_spec(path, [override])
    assert info.value.problems == [Problem(f"--set {override}", message)]


def test_malformed_override_masks_credentials(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(SpecError) as info:
        load_spec(path, ["data[0].url=s3://KEY:SECRET@bucket/x"])
    assert info.value.problems == [Problem(
        "--set data[0].url=s3://***@bucket/x", "index 0 is out of range: data has no items"
    )]


def test_relative_paths_resolve_against_spec_dir_and_overrides_against_cwd(tmp_path, monkeypatch):
    spec_dir = tmp_path / "specs" / "nightly"
    spec_dir.mkdir(parents=True)
    cwd = tmp_path / "work"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = write(spec_dir, MINIMAL.replace("url: /out/job/", "url: ../../results/job/") + (
        "data:\n"
        "  - {name: a, url: data/a.csv}\n"
        "  - {name: b, url: s3://bucket/b.csv}\n"
        "  - {name: c, url: /abs/c.csv}\n"
        "  - {name: d, url: ~/d.csv}\n"
        "  - {name: e, url: 'simplecache::s3://bucket/e.csv'}\n"
        "  - {name: f, url: ./f/}\n"
        "  - {name: g, url: g.csv}\n"
    ))
    spec = load_spec(path, ["data[6].url=mine/g.csv", "output.checkpoint.url=ckpt/"])
    assert [d.url for d in spec.data] == [
        f"{spec_dir}/data/a.csv",
        "s3://bucket/b.csv",
        "/abs/c.csv",
        f"{tmp_path}/home/d.csv",
        "simplecache::s3://bucket/e.csv",
        f"{spec_dir}/f/",
        f"{cwd}/mine/g.csv",
    ]
    assert spec.output.url == f"{tmp_path}/results/job/"
    assert spec.output.checkpoint.url == f"{cwd}/ckpt/"


def test_relative_checkpoint_url_in_file_resolves_against_spec_dir(tmp_path):
    path = write(tmp_path, MINIMAL.replace("files: [metrics.json]", "files: [metrics.json], checkpoint: {url: ck}"))
    assert load_spec(path).output.checkpoint.url == f"{tmp_path}/ck"


def test_override_of_a_whole_section_counts_as_override(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = parse_spec(MINIMAL, base_dir="/specs", overrides=["output={kind: files, url: out, files: [x]}"])
    assert spec.output.url == f"{tmp_path}/out"


def test_parse_spec_without_base_dir_keeps_relative_paths():
    spec = parse_spec(MINIMAL.replace("url: /out/job/", "url: out/") + "data: [{name: d, url: in.csv}]\n")
    assert spec.output.url == "out/"
    assert spec.data[0].url == "in.csv"


def test_parse_spec_with_base_dir_and_mapping_is_not_modified():
    data = {
        "name": "job",
        "work": {"kind": "simulation", "command": ["./sim", "--steps", 10]},
        "data": [{"name": "d", "url": "in.csv"}],
        "request": {"duration": "5m"},
        "output": {"kind": "files", "url": "out", "files": ["traj.h5"]},
    }
    spec = parse_spec(data, base_dir="/base")
    assert spec.data[0].url == "/base/in.csv"
    assert spec.output.url == "/base/out"
    assert data["data"][0]["url"] == "in.csv"
    assert spec.work.command == ["./sim", "--steps", "10"]


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value) == (
        f"invalid job spec {path} (1 problem)\n  (spec): file not found (got '{path}'); check the path"
    )


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path)
    assert info.value.problems == [Problem("(spec)", f"is a directory, not a spec file (got '{tmp_path}')")]


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    path = write(tmp_path, "name: job\nwork:\n  kind: training\n entrypoint: x:y\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value) == (
        f"invalid job spec {path} (1 problem)\n"
        f"  {path}:4:2: YAML syntax error: expected <block end>, but found '<block mapping start>'"
    )


def test_json_spec(tmp_path):
    import json

    data = {
        "name": "job", "work": {"kind": "inference", "entrypoint": "m:f"},
        "request": {"limit": 60}, "output": {"kind": "results", "url": "out/", "files": ["p.csv"]},
    }
    path = write(tmp_path, json.dumps(data), "job.json")
    spec = load_spec(path)
    assert spec.request.limit == timedelta(seconds=60)
    assert spec.output.url == f"{tmp_path}/out/"


def test_json_syntax_error_and_duplicate_keys(tmp_path):
    bad = write(tmp_path, '{"name": "job",\n  "work": }', "bad.json")
    with pytest.raises(SpecError) as info:
        load_spec(bad)
    assert info.value.problems == [Problem(f"{bad}:2:11", "JSON syntax error: Expecting value")]
    dup = write(tmp_path, '{"name": "a", "name": "b"}', "dup.json")
    with pytest.raises(SpecError) as info:
        load_spec(dup)
    assert info.value.problems[0] == Problem("name", "duplicate key (got it more than once); keep one")


def test_models_constructible_from_python():
    spec = JobSpec(
        name="py-job",
        work=WorkSpec(kind="processing", command=["echo", "hi"]),
        request=RequestSpec(limit=timedelta(minutes=5), memory="100KiB",
                            deadline=datetime(2999, 1, 1, tzinfo=timezone.utc)),
        output=OutputSpec(kind="report", url="/r/", files=["report.html"]),
    )
    assert spec.request.memory == 102_400
    assert spec.output.checkpoint == CheckpointPolicy(every=None, every_steps=None, keep=3, url=None)
    assert spec.data == []
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec


def test_python_construction_reports_all_problems_as_a_spec_error():
    from e31.specs import SpecError

    with pytest.raises(SpecError) as info:
        RequestSpec(gpus=-1, port=80)
    assert info.value.source == "<RequestSpec>"
    assert [p.path for p in info.value.problems] == ["gpus", "port", "(spec)"]


def test_alias_bomb_is_refused_quickly(tmp_path):
    import time

    from e31.specs import SpecError, load_spec

    levels = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        levels.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text(
        "name: bomb\nwork:\n  kind: processing\n  command: [x]\n  params:\n    x:\n"
        + "".join(f"      {line}\n" for line in levels)
        + "request: {limit: 1m}\noutput: {kind: results, url: /o, files: [x]}\n"
    )
    started = time.monotonic()
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert time.monotonic() - started < 2
    assert str(err.value) == (
        f"invalid job spec {path} (1 problem)\n"
        f"  {path}: the document holds more than 20,000 values (aliases expanded); a spec holds tens: put large "
        "data in an input, not the spec"
    )


def test_override_keeps_digit_strings_that_a_number_would_change(tmp_path):
    path = write(tmp_path, MINIMAL + "data: [{name: a, url: /a}, {name: b, url: /b}, {name: c, url: /c}]\n")
    zeros, leading = "0" * 64, "0078" + "1" * 60
    spec = load_spec(path, [
        f"data[2].sha256={zeros}",
        f"data[1].sha256={leading}",
        "data[0].sha256=0012ab" + "c" * 58,
        "request.cpus=4",
        "work.params.count=12",
        "work.params.neg=-3",
        "work.params.code=007",
        "work.params.plus=+4",
        "work.params.hex=0x1F",
        "work.params.oct=0o17",
        "work.params.under=1_000",
        "work.params.seeds=[007, 8, '09']",
        "work.params.lr=1e-3",
    ])
    assert spec.data[2].sha256 == zeros
    assert spec.data[1].sha256 == leading
    assert spec.data[0].sha256 == "0012ab" + "c" * 58
    assert spec.request.cpus == 4 and type(spec.request.cpus) is int
    assert spec.work.params == {
        "count": 12, "neg": -3, "code": "007", "plus": "+4", "hex": "0x1F", "oct": "0o17", "under": "1_000",
        "seeds": ["007", 8, "09"], "lr": 0.001,
    }
    assert type(spec.work.params["count"]) is int


def test_override_of_an_int_field_with_a_signed_number_names_it(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(SpecError) as info:
        load_spec(path, ["request.cpus=+4"])
    assert str(info.value) == f"invalid job spec {path} (1 problem)\n  request.cpus: must be a whole number (got '+4')"


def test_spec_files_keep_yaml_numbers():
    spec = parse_spec(MINIMAL.replace("entrypoint: pkg.mod:main}", "entrypoint: pkg.mod:main, params: {dec: 010, hex: 0x1F}}"))
    assert spec.work.params == {"dec": 10, "hex": 31}


def test_an_empty_override_value_is_the_empty_string_and_null_clears(tmp_path):
    """`--set name=` is the empty string, refused with the full rule, not
    'must be a string (got None)'."""
    path = write(tmp_path, MINIMAL)
    with pytest.raises(SpecError) as info:
        load_spec(path, ["name="])
    assert [str(p) for p in info.value.problems] == [
        "name: must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit (got ''); it names "
        "the run and its folder, e.g. digits-nightly-retrain"]
    spec = load_spec(path, ["work.params.note=", "work.params.gone=null"])
    assert spec.work.params["note"] == "" and spec.work.params["gone"] is None
