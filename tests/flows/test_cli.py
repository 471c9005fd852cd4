"""The ``e31`` command line: exact output and exit codes, no tracebacks."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "specs" / "examples" / "digits-nightly-retrain.yaml"
EXAMPLES = REPO / "specs" / "examples"


def test_validate_example(e31):
    result = e31("validate", str(EXAMPLE))
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "valid: digits-nightly-retrain (training: e31.examples.digits:train); 1 input(s); 0 gpu, 1 cpu, "
        f"limit 0:10:00; output model -> {EXAMPLES}/results/digits-nightly-retrain/\n"
    )


@pytest.mark.parametrize(("field", "value", "said"), [
    ("deadline", "2031-05-02T06:00:00+00:00", ", deadline 2031-05-02T06:00:00+00:00"),
    ("deadline_within", "2h", ", deadline within 2:00:00 of the start"),
    ("deadline_at", "06:00 Europe/London", ", deadline 06:00 Europe/London daily"),
])
def test_validate_says_the_deadline(e31, field, value, said):
    """``e31 validate`` says the deadline too, not only ``e31 compile``."""
    result = e31("validate", str(EXAMPLE), "--set", f"request.{field}={value}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == (
        f"valid: digits-nightly-retrain (training: e31.examples.digits:train); 1 input(s); 0 gpu, 1 cpu, "
        f"limit 0:10:00{said}; output model -> {EXAMPLES}/results/digits-nightly-retrain/")


def test_validate_notes_a_request_larger_than_this_machine(e31):
    """Valid (a pool may hold it), with a note of what ``e31 run`` would refuse here."""
    from e31.flows.admission import this_node

    here = this_node()
    result = e31("validate", str(EXAMPLE), "--set", f"request.gpus={here.gpus + 2}",
                 "--set", f"request.cpus={here.cpus + 1}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == [
        f"note: e31 run would refuse it on this machine: request.gpus: {here.gpus + 2} requested, this machine has "
        f"{here.gpus}; request.cpus: {here.cpus + 1} requested, this machine has {here.cpus} (e31 plan SPEC --pool "
        "POOL.yaml checks it against a pool's nodes)"]


def test_validate_bad_spec_lists_every_problem(e31, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: nightly\nwork: {kind: training, entrypoint: 'a:b'}\n"
        "data:\n  - {name: d, urll: x}\n"
        "request: {gpus: -1, limit: 1h}\n"
        "output: {kind: model, url: /tmp/o, files: [m.pt]}\n"
    )
    result = e31("validate", str(bad))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        f"invalid job spec {bad} (2 problems)\n"
        "  request.gpus: must be >= 0 (got -1)\n"
        "  data[0].urll: unknown field; did you mean 'url'?\n"
    )


def test_yaml_syntax_error_gives_line_and_column(e31, tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: x\nwork: {kind: training\n")
    result = e31("validate", str(bad))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[0] == f"invalid job spec {bad} (1 problem)"
    assert result.stderr.splitlines()[1].startswith(f"  {bad}:3:1: YAML syntax error:")


def test_schema_validates_the_example(e31):
    result = e31("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert set(schema["required"]) >= {"name", "work", "request", "output"}
    jsonschema.validate(yaml.safe_load(EXAMPLE.read_text()), schema)


def test_compile_prints_the_plan_with_overrides(e31, tmp_path):
    result = e31(
        "compile", str(EXAMPLE), "--set", "request.limit=20s", "--set", f"output.url={tmp_path}/out",
        env={"E31_SCRATCH": str(tmp_path / "scratch")},
    )
    assert result.returncode == 0, result.stderr
    scratch = tmp_path / "scratch" / "digits-nightly-retrain"
    lines = result.stdout.splitlines()
    assert lines[0].startswith("job digits-nightly-retrain (spec sha256 ")
    assert lines[1:] == [
        f"  stage (1 input) into {scratch}/data",
        f"    digits: {EXAMPLES}/data/digits.csv.gz (sha256 09f66e6debde...)",
        f"  run on cpu: 1 cpu, 0 gpu; scratch {scratch}",
        "    stop after 20s (time_limit); warning 10s before the hard stop",
        f"  checkpoint every 1 steps, keep 3, durable at {tmp_path}/out/checkpoints",
        f"  return model.pt, metrics.json (+ manifest.json) to {tmp_path}/out",
        "  preemptible: yes (default: it declares checkpoints and no deadline)",
        "  data: 1 input(s), 1 file(s), 56.2 KiB (57523 bytes); ~0 s to stage at 200 MiB/s",
        "    digits: file, 1 file(s), 56.2 KiB",
    ]


def test_compile_names_a_missing_input_and_no_list_skips_the_listing(e31, tmp_path):
    missing = tmp_path / "nope.csv.gz"
    result = e31("compile", str(EXAMPLE), "--set", f"data[0].url={missing}")
    assert result.returncode == 1
    assert result.stderr == f"e31: data 'digits': {missing}: not found\n"
    assert result.stdout.splitlines()[-2].startswith("  return model.pt, metrics.json (+ manifest.json) to ")
    assert result.stdout.splitlines()[-1] == "  preemptible: yes (default: it declares checkpoints and no deadline)"
    skipped = e31("compile", str(EXAMPLE), "--no-list", "--set", f"data[0].url={missing}")
    assert skipped.returncode == 0 and "data:" not in skipped.stdout


def test_bad_override_is_an_invalid_spec(e31):
    result = e31("compile", str(EXAMPLE), "--set", "request.limit=soon")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[0] == f"invalid job spec {EXAMPLE} (1 problem)"
    assert result.stderr.splitlines()[1].startswith("  request.limit: ")
    assert "(got 'soon')" in result.stderr


def test_run_missing_input_fails_cleanly(e31, prefect_api, tmp_path):
    result = e31(
        "run", str(EXAMPLE), "--set", f"data[0].url={tmp_path}/nope.csv.gz", "--set", f"output.url={tmp_path}/out",
        env={"E31_SCRATCH": str(tmp_path / "scratch")},
    )
    assert result.returncode == 1
    assert f"e31: data 'digits': {tmp_path}/nope.csv.gz: not found" in result.stderr
    assert "Traceback" not in result.stderr
    # nothing ran; the destination says so in partial/, so no older manifest is taken for this run's
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["partial"]
    assert [p.name for p in (tmp_path / "out" / "partial").iterdir()] == ["manifest.json"]
    manifest = json.loads((tmp_path / "out" / "partial" / "manifest.json").read_text())
    assert (manifest["status"], manifest["reason"], manifest["files"]) == ("failed", "error", [])
    assert manifest["message"] == f"data 'digits': {tmp_path}/nope.csv.gz: not found"


def test_run_refuses_a_request_larger_than_this_machine(e31, prefect_api, tmp_path):
    result = e31(
        "run", str(EXAMPLE), "--set", "request.gpus=8", "--set", f"output.url={tmp_path}/out",
        env={"E31_SCRATCH": str(tmp_path / "scratch"), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 1
    import os

    assert (f"e31: request does not fit this machine ({os.uname().nodename}):\n  request.gpus: 8 requested, this "
            "machine has 0\n  ask for no more than it has, or deploy the job (e31 deploy) to a work pool whose workers "
            "run where the resources are\n") in result.stderr
    assert "Traceback" not in result.stderr


def test_compile_prints_a_gang_and_run_refuses_it_in_one_line(e31, prefect_api, tmp_path):
    """request.nodes: 2: ``e31 compile`` says what each node gets and the total; ``e31 run`` refuses it
    (one node would run) with the one-line fix, before a flow run or a staged file exists."""
    sets = ["--set", "request.nodes=2", "--set", "request.gpus=4", "--set", "request.cpus=8", "--set",
            f"output.url={tmp_path}/out"]
    env = {"E31_SCRATCH": str(tmp_path / "scratch")}
    compiled = e31("compile", str(EXAMPLE), "--no-list", *sets, env=env)
    assert compiled.returncode == 0, compiled.stderr
    assert compiled.stdout.splitlines()[3] == (
        "  run on 2 nodes at once (a gang: all start together or none), each on cuda: 8 cpu, 4 gpu, 2GiB (16 cpu, "
        f"8 gpu, 4GiB in all); scratch {tmp_path}/scratch/digits-nightly-retrain on each")
    assert "  preemptible: no (a job of several nodes is never preempted)" in compiled.stdout.splitlines()
    ran = e31("run", str(EXAMPLE), *sets, env=env)
    assert (ran.returncode, ran.stderr) == (1, "e31: request.nodes: 2: a job across several nodes runs in a queue, "
                                               "which starts it on 2 nodes at once: e31 submit SPEC --pool POOL; e31 "
                                               "run and the flow called directly start one node (or set "
                                               "request.nodes: 1; gpus, cpus and memory are per node)\n")
    assert not (tmp_path / "scratch").exists() and not (tmp_path / "out").exists()
    checked = e31("validate", str(EXAMPLE), *sets, env=env)
    assert checked.returncode == 0 and checked.stdout.splitlines()[-1] == (
        "note: e31 run would refuse it: " + ran.stderr[len("e31: "):].rstrip())  # e31 submit runs it


def test_bad_return_reserve_setting_is_named(e31):
    result = e31("compile", str(EXAMPLE), env={"E31_RETURN_RESERVE_S": "abc"})
    assert result.returncode == 2
    assert result.stderr == "e31: E31_RETURN_RESERVE_S must be a number of seconds >= 0 (got 'abc')\n"


def test_schema_into_a_closed_pipe_is_quiet():
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("e31")
    result = subprocess.run(f"'{exe}' schema | head -1", shell=True, capture_output=True, text=True)
    assert result.stdout == "{\n" and result.stderr == ""


@pytest.mark.parametrize("name, value, expected", [
    ("E31_STAGE_RATE_MIBS", "0", "e31: E31_STAGE_RATE_MIBS must be a number of MiB/s, above 0 and at most 1e+07 "
                                 "(got '0'); unset it for the default 200\n"),
    ("E31_STAGE_RATE_MIBS", "abc", "e31: E31_STAGE_RATE_MIBS must be a number of MiB/s, above 0 and at most 1e+07 "
                                   "(got 'abc'); unset it for the default 200\n"),
    ("E31_STAGE_RATE_MIBS", "nan", "e31: E31_STAGE_RATE_MIBS must be a number of MiB/s, above 0 and at most 1e+07 "
                                   "(got 'nan'); unset it for the default 200\n"),
    ("E31_TRANSFER_RETRIES", "-1", "e31: E31_TRANSFER_RETRIES must be a whole number of retries, at least 0 and at "
                                   "most 100 (got '-1'); unset it for the default 3\n"),
    ("E31_TRANSFER_RETRIES", "1.5", "e31: E31_TRANSFER_RETRIES must be a whole number of retries, at least 0 and at "
                                    "most 100 (got '1.5'); unset it for the default 3\n"),
    ("E31_TRANSFER_BACKOFF_S", "-2", "e31: E31_TRANSFER_BACKOFF_S must be a number of seconds, at least 0 and at "
                                     "most 3600 (got '-2'); unset it for the default 2\n"),
    ("E31_STREAMS_PER_FILE", "0", None),
    ("E31_API_TIMEOUT_S", "0.001", "e31: E31_API_TIMEOUT_S must be a number of seconds, at least 1 and at most 3600 "
                                   "(got '0.001'); unset it for the default 15\n"),
])
def test_bad_tuning_setting_is_named_before_anything_runs(e31, tmp_path, name, value, expected):
    for command in ("compile", "run"):
        result = e31(command, str(EXAMPLE), "--set", f"output.url={tmp_path / 'out'}",
                     env={name: value, "E31_SCRATCH": str(tmp_path / "scratch")})
        assert result.returncode == 2, result.stderr
        if expected is None:
            assert result.stderr.startswith(f"e31: {name} must be a whole number of streams, at least 1 and at most 64 "
                                            f"(got '0'); unset it for the default ")
        else:
            assert result.stderr == expected
    assert not (tmp_path / "out").exists() and not (tmp_path / "scratch").exists()


def test_urls_without_a_backend_are_refused_by_validate_compile_and_run(e31, tmp_path):
    """Unknown protocols and backends not installed here fail before
    anything runs, reported with every other problem of the spec, each named
    with its field and the protocols this machine has (gcsfs and adlfs are
    not installed in the test environment)."""
    args = ["--set", "output.url=s4://bucket/out/", "--set", "data[0].url=gs://bucket/digits.csv.gz",
            "--set", "output.checkpoint.url=az://container/ck/", "--set", "request.gpus=-1"]
    for command in ("validate", "compile", "run"):
        result = e31(command, str(EXAMPLE), *args, env={"E31_SCRATCH": str(tmp_path / "scratch")})
        assert result.returncode == 2, result.stderr
        assert result.stderr == (
            f"invalid job spec {EXAMPLE} (4 problems)\n"
            "  request.gpus: must be >= 0 (got -1)\n"
            "  data[0].url: protocol 'gs' is not installed here (got gs://bucket/digits.csv.gz): Please install "
            "gcsfs to access Google Storage\n"
            "  output.url: unknown protocol 's4' (got s4://bucket/out/); use a local path or one of file, memory, "
            "http, https, s3; with a package installed: gs (gcsfs), az (adlfs), abfs (adlfs)\n"
            "  output.checkpoint.url: protocol 'az' is not installed here (got az://container/ck/): Install adlfs "
            "to access Azure Datalake Gen2 and Azure Blob Storage\n")
    assert not (tmp_path / "scratch").exists()


def test_a_misspelt_entrypoint_is_refused_with_the_closest_name(e31, tmp_path):
    """The entrypoint's module is found and its source read (not run): a
    function it does not define is refused with the closest name; a module
    not importable here is noted as not checked."""
    result = e31("validate", str(EXAMPLE), "--set", "work.entrypoint=e31.examples.digits:trian")
    assert result.returncode == 2
    assert result.stderr == (
        f"invalid job spec {EXAMPLE} (1 problem)\n"
        "  work.entrypoint: e31.examples.digits has no 'trian' (got 'e31.examples.digits:trian'); did you mean "
        "e31.examples.digits:train?\n")
    beside = tmp_path / "job.yaml"
    beside.write_text(EXAMPLE.read_text().replace("e31.examples.digits:train", "mywork:go"))
    (tmp_path / "mywork.py").write_text("def go(ctx):\n    pass\n")
    data = f"data[0].url={EXAMPLES / 'data' / 'digits.csv.gz'}"
    assert e31("validate", str(beside), "--set", data).returncode == 0
    result = e31("validate", str(beside), "--set", data, "--set", "work.entrypoint=mywork:goo")
    assert result.returncode == 2 and "did you mean mywork:go?" in result.stderr
    result = e31("validate", str(EXAMPLE), "--set", "work.entrypoint=somewhere.other:train")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1] == (
        "note: work.entrypoint 'somewhere.other:train' not checked: module 'somewhere.other' is not importable here "
        "(it must be where the job runs: installed, or beside the spec)")


def test_an_entrypoint_in_e31_misspelt_or_from_before_the_package_is_refused_with_the_name(e31):
    for given in ("e31.exmples.digits:train", "examples.digits:train"):
        result = e31("validate", str(EXAMPLE), "--set", f"work.entrypoint={given}")
        assert result.returncode == 2
        assert result.stderr.splitlines()[1] == (
            f"  work.entrypoint: no module {given.split(':')[0]!r} (got {given!r}); did you mean "
            "e31.examples.digits:train? (E31's own modules are under e31.)")


def test_version(e31):
    from e31 import __version__

    result = e31("--version")
    assert (result.returncode, result.stdout) == (0, f"e31 {__version__}\n")


def test_memory_outputs_are_refused_by_run_and_deploy_but_validate(e31, tmp_path):
    """memory:// lives in one process: e31 run (or a worker) would return into
    memory that is gone when it exits.  The spec itself is valid (calling the
    flow from Python can use it), so validate accepts it."""
    args = ["--set", "output.url=memory://results/digits/", "--set", "output.checkpoint.url=memory://ck/digits/"]
    env = {"E31_SCRATCH": str(tmp_path / "scratch")}
    assert e31("validate", str(EXAMPLE), *args, env=env).returncode == 0
    reason = ("memory:// lives only inside one Python process and would be gone when this run ends; return to a "
              "folder or an object store (s3://, gs://, az://)\n")
    for command in (["run"], ["deploy", "--pool", "nowhere"]):
        result = e31(*command, str(EXAMPLE), *args, env=env)
        assert result.returncode == 2, result.stderr
        assert result.stderr == (f"e31: output.url: memory://results/digits/: {reason}"
                                 f"e31: output.checkpoint.url: memory://ck/digits/: {reason}")
    assert not (tmp_path / "scratch").exists()


def test_compile_says_an_input_host_does_not_resolve_or_answer(e31):
    """A host that is down or unknown is said as such, not read as 'not found'."""
    import socket

    unknown = e31("compile", str(EXAMPLE), "--set", "data[0].url=http://no-such-host.invalid/x.csv")
    assert (unknown.returncode, unknown.stderr) == (1, (
        "e31: data 'digits': http://no-such-host.invalid/x.csv: the host no-such-host.invalid does not resolve "
        "(no such name); check the host name in the URL\n"))
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = e31("compile", str(EXAMPLE), "--set", f"data[0].url=http://127.0.0.1:{port}/x.csv")
    assert (down.returncode, down.stderr) == (1, (
        f"e31: data 'digits': http://127.0.0.1:{port}/x.csv: the host 127.0.0.1:{port} did not answer (connection "
        "refused); check that its server is running and the URL's host and port\n"))
