"""Jobs whose data, checkpoints and output live on a real S3 server.

A real SeaweedFS (``s3_server`` fixture, 127.0.0.1) and a real ``prefect
server start`` (``prefect_api``); ``e31 run`` in a subprocess, as a user
runs it.  The server's secret is a planted string: no log, CLI output,
Prefect parameter, artifact, manifest or scratch file may contain it, nor
the signature of a presigned URL the job reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import textwrap
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from tests.conftest import S3_SECRET

WORK = '''
import os, signal
from pathlib import Path


def copy_inputs(ctx):
    """Writes the sha256 of every staged file, then a result."""
    import hashlib
    lines = []
    for name, path in sorted(ctx.data.items()):
        root = Path(path)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            rel = f.name if root.is_file() else f.relative_to(root).as_posix()
            lines.append(f"{name}/{rel} {hashlib.sha256(f.read_bytes()).hexdigest()}")
    (ctx.output_dir / "hashes.txt").write_text("\\n".join(lines) + "\\n")
    ctx.checkpoint({"step": 1}, step=1, wait=True)
    (ctx.output_dir / "sub").mkdir(exist_ok=True)
    (ctx.output_dir / "sub" / "result.bin").write_bytes(b"r" * 300_000)


def kill_store_then_write(ctx):
    """Kills the destination's S3 server (its process group), then writes the
    output; each run appends a line to params.runs_log."""
    with open(ctx.params["runs_log"], "a") as log:
        log.write("ran\\n")
    try:
        os.killpg(int(ctx.params["store_pgid"]), signal.SIGKILL)
    except ProcessLookupError:  # a later run: that server is gone already
        pass
    ctx.checkpoint({"made": "while the store was down"}, step=7, wait=True)  # committed here, cannot be uploaded
    (ctx.output_dir / "result.txt").write_text("made while the store was down\\n")
'''


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _spec(tmp_path: Path, name: str, body: str) -> Path:
    (tmp_path / "storework.py").write_text(WORK)
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def _flow_run_evidence(flow_run_name: str, *, with_tasks: bool = True) -> str:
    """Everything Prefect keeps of the newest flow run named so: parameters,
    logs, artifacts, task run names, as one text."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter,
                                                FlowRunFilterName, FlowRunFilterId, LogFilter, LogFilterFlowRunId)
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run_name])),
                                     sort=FlowRunSort.START_TIME_DESC, limit=1)
        run = runs[0]
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    parts = [json.dumps(run.parameters), run.name, str(run.state.message if run.state else "")]
    parts += [log.message for log in logs]
    parts += [f"{a.key} {a.description} {json.dumps(a.data)}" for a in artifacts]
    parts += [t.name + " " + str(t.state.message if t.state else "") for t in tasks]
    assert logs and artifacts and (tasks or not with_tasks)  # the evidence is really there
    return "\n".join(parts)


def _all_text_under(root: Path) -> str:
    return "\n".join(p.read_bytes().decode(errors="replace") for p in root.rglob("*") if p.is_file())


@pytest.mark.slow
def test_job_over_s3_with_secret_block_and_presigned_url_leaks_no_secret(e31, tmp_path, s3_server, s3_prefix,
                                                                        prefect_api, scratch):
    from prefect.blocks.system import Secret

    fs = s3_server.filesystem()
    files = {"frames/a.txt": b"alpha\n", "frames/deep/b.txt": b"beta" * 1000, "frames/deep/c.bin": os.urandom(70_000)}
    for rel, data in files.items():
        fs.pipe(f"{s3_prefix}data/{rel}".removeprefix("s3://"), data)
    fs.pipe(f"{s3_prefix}signed/table.csv".removeprefix("s3://"), b"x,y\n1,2\n")
    presigned = fs.url(f"{s3_prefix}signed/table.csv".removeprefix("s3://"), expires=600)
    signature = parse_qs(urlparse(presigned).query)["Signature"][0]  # s3fs signs query-string style (SigV2)
    raw_signature = dict(kv.split("=", 1) for kv in urlparse(presigned).query.split("&"))["Signature"]
    Secret(value=S3_SECRET).save("e31-test-s3-secret", overwrite=True)
    spec = _spec(tmp_path, "s3job", f"""
        name: s3job
        work: {{kind: processing, entrypoint: "storework:copy_inputs"}}
        data:
          - name: frames
            url: {s3_prefix}data/frames
            storage_options: {{key: {{env: E31_TEST_S3_KEY}}, secret: {{secret: e31-test-s3-secret}}}}
          - name: table
            url: "{presigned}"
        request: {{cpus: 1, limit: 2m}}
        output:
          kind: files
          url: {s3_prefix}out/
          files: [hashes.txt, sub/result.bin]
          storage_options: {{key: {{env: E31_TEST_S3_KEY}}, secret: {{secret: e31-test-s3-secret}}}}
        """)
    env = {"E31_TEST_S3_KEY": s3_server.key, "AWS_SECRET_ACCESS_KEY": "wrong-on-purpose",  # the block must be used
           "PREFECT_LOGGING_LEVEL": "INFO"}  # every log line reaches the API, to be searched
    compiled = e31("compile", str(spec), env=env)
    result = e31("run", str(spec), env=env)
    assert result.returncode == 0, result.stderr
    assert compiled.returncode == 0, compiled.stderr
    assert compiled.stdout.endswith("  data: 2 input(s), 4 file(s), 72.3 KiB (74014 bytes); ~0 s to stage at 200 MiB/s\n"
                                    "    frames: folder, 3 file(s), 72.3 KiB\n    table: file, 1 file(s), 8 B\n")
    manifest = json.loads(fs.cat(f"{s3_prefix}out/manifest.json".removeprefix("s3://")))
    assert manifest["status"] == "completed" and manifest["step"] == 1
    expected_hashes = "".join(f"frames/{rel.removeprefix('frames/')} {_sha(data)}\n" for rel, data in sorted(files.items()))
    expected_hashes += f"table/table.csv {_sha(b'x,y' + chr(10).encode() + b'1,2' + chr(10).encode())}\n"
    got = fs.cat(f"{s3_prefix}out/hashes.txt".removeprefix("s3://"))
    assert got.decode() == expected_hashes
    assert [(f["path"], f["bytes"], f["sha256"]) for f in manifest["files"]] == [
        ("hashes.txt", len(got), _sha(got)), ("sub/result.bin", 300_000, _sha(b"r" * 300_000))]
    assert manifest["checkpoint"] == f"{s3_prefix}out/checkpoints/step-1"
    # no temporary or probe objects left next to the output
    left = sorted(p.removeprefix(f"{s3_prefix}out/".removeprefix("s3://")) for p in fs.find(f"{s3_prefix}out/"))
    assert left == ["checkpoints/step-1/COMMITTED", "checkpoints/step-1/state.pt", "hashes.txt", "manifest.json",
                    "sub/result.bin"]
    # the planted secret and the presigned signature are nowhere
    evidence = "\n".join([compiled.stdout, compiled.stderr, result.stdout, result.stderr, _flow_run_evidence("s3job"),
                          json.dumps(manifest), _all_text_under(scratch)])
    assert "Signature=***" in evidence  # the URL is shown, masked
    for secret in (S3_SECRET, signature, raw_signature):
        assert secret not in evidence


@pytest.mark.slow
def test_bad_credentials_fail_before_running_and_do_not_echo_the_secret(e31, tmp_path, s3_server, s3_prefix,
                                                                       prefect_api, scratch):
    from prefect.blocks.system import Secret

    planted = "e31-WRONG-planted-4Kz9"
    Secret(value=planted).save("e31-test-wrong-secret", overwrite=True)
    spec = _spec(tmp_path, "badcreds", f"""
        name: badcreds
        work: {{kind: processing, entrypoint: "storework:copy_inputs"}}
        request: {{cpus: 1, limit: 1m}}
        output:
          kind: files
          url: {s3_prefix}out/
          files: [hashes.txt]
          storage_options: {{key: {{env: E31_TEST_S3_KEY}}, secret: {{secret: e31-test-wrong-secret}}}}
        """)
    result = e31("run", str(spec), env={"E31_TEST_S3_KEY": s3_server.key, "PREFECT_LOGGING_LEVEL": "INFO"})
    assert result.returncode == 1
    assert f"e31: output.url: {s3_prefix}out/: cannot write there (PermissionError: " in result.stderr
    assert result.stderr.endswith("The request signature we calculated does not match the signature you provided. "
                                  "Check your key and signing method.)\n")
    assert planted not in result.stderr + result.stdout + _flow_run_evidence("badcreds", with_tasks=False)
    assert not s3_server.filesystem().find(f"{s3_prefix}out/")  # nothing written


@pytest.mark.slow
def _run_while_destination_dies(e31, tmp_path, scratch, name: str) -> tuple[Path, Path]:
    """``e31 run`` of a job whose work kills the destination's S3 server
    before writing result.txt: exit 1, the output kept in scratch with
    return-pending.json.  Returns (spec, job scratch)."""
    from tests.conftest import S3_BUCKET, S3_KEY
    from tests.s3server import S3Server

    store = S3Server(tmp_path / "store1", key=S3_KEY, secret=S3_SECRET, bucket=S3_BUCKET).start()
    spec = _spec(tmp_path, name, f"""
        name: {name}
        work:
          kind: processing
          entrypoint: "storework:kill_store_then_write"
          params: {{store_pgid: {store.proc.pid}, runs_log: "{tmp_path / 'runs.log'}"}}
        request: {{cpus: 1, limit: 2m}}
        output:
          kind: results
          url: s3://{S3_BUCKET}/{name}/out/
          files: [result.txt]
          storage_options: {{config_kwargs: {{connect_timeout: 1, retries: {{max_attempts: 1}}}}}}
        """)
    env = {**store.env(), "E31_TRANSFER_RETRIES": "1", "E31_TRANSFER_BACKOFF_S": "0.2"}
    try:
        result = e31("run", str(spec), env=env)
    finally:
        store.proc.wait(timeout=10)
        store.proc = None
    assert result.returncode == 1
    job_scratch = scratch / name
    assert f"it is kept in {job_scratch / 'output'}" in result.stderr
    assert f"deliver it later with: e31 return {name}" in result.stderr
    assert "Traceback" not in result.stderr  # the store's errors are logged in one line each
    pending = json.loads((job_scratch / "return-pending.json").read_text())
    assert pending["manifest"]["kept_in"] == str(job_scratch / "output")
    assert pending["manifest"]["delivered"] is False and pending["manifest"]["reason"] == "finished"
    assert pending["kept"] == {"result.txt": 30}
    assert (job_scratch / "output" / "result.txt").read_text() == "made while the store was down\n"
    assert S3_SECRET not in json.dumps(pending)
    assert (tmp_path / "runs.log").read_text() == "ran\n"
    return spec, job_scratch


def test_unreachable_destination_keeps_output_for_e31_return(e31, tmp_path, prefect_api, scratch):
    from tests.conftest import S3_BUCKET, S3_KEY
    from tests.s3server import S3Server

    _, job_scratch = _run_while_destination_dies(e31, tmp_path, scratch, "laterjob")
    store2 = S3Server(tmp_path / "store2", key=S3_KEY, secret=S3_SECRET, bucket=S3_BUCKET).start()
    try:
        back = e31("return", "laterjob", env=store2.env())
        assert back.returncode == 0, back.stderr
        assert back.stdout.startswith(f"completed (finished): laterjob -> s3://{S3_BUCKET}/laterjob/out/\n")
        fs = store2.filesystem()
        manifest = json.loads(fs.cat(f"{S3_BUCKET}/laterjob/out/manifest.json"))
        assert manifest["status"] == "completed"
        assert fs.cat(f"{S3_BUCKET}/laterjob/out/result.txt") == b"made while the store was down\n"
        assert manifest["files"] == [{"path": "result.txt", "bytes": 30,
                                      "sha256": _sha(b"made while the store was down\n")}]
        # the checkpoint committed while the store was down went with it
        assert (manifest["step"], manifest["checkpoint"]) == (7, f"s3://{S3_BUCKET}/laterjob/out/checkpoints/step-7")
        assert sorted(fs.ls(f"{S3_BUCKET}/laterjob/out/checkpoints/step-7/")) == [
            f"{S3_BUCKET}/laterjob/out/checkpoints/step-7/COMMITTED",
            f"{S3_BUCKET}/laterjob/out/checkpoints/step-7/state.pt"]
        assert not (job_scratch / "return-pending.json").exists()
        assert not (job_scratch / "output").exists()  # deleted only after the destination verified it
        again = e31("return", "laterjob", env=store2.env())
        assert again.returncode == 1 and "e31: nothing to return for laterjob" in again.stderr
    finally:
        store2.stop()


def test_running_the_job_again_delivers_the_kept_output_without_running_the_work(e31, tmp_path, prefect_api,
                                                                                  scratch):
    """The README's other way to deliver a kept output: `e31 run` of the
    same job again delivers what the first run made (the work does not run
    again) and reports the job completed."""
    from tests.conftest import S3_BUCKET, S3_KEY
    from tests.s3server import S3Server

    spec, job_scratch = _run_while_destination_dies(e31, tmp_path, scratch, "rerunjob")
    store2 = S3Server(tmp_path / "store2", key=S3_KEY, secret=S3_SECRET, bucket=S3_BUCKET).start()
    try:
        again = e31("run", str(spec), env=store2.env())
        assert again.returncode == 0, again.stderr
        assert again.stdout.startswith(f"completed (finished): rerunjob -> s3://{S3_BUCKET}/rerunjob/out/\n")
        assert (tmp_path / "runs.log").read_text() == "ran\n"  # the work did not run a second time
        fs = store2.filesystem()
        assert sorted(fs.find(f"{S3_BUCKET}/rerunjob/out/")) == [
            f"{S3_BUCKET}/rerunjob/out/{name}" for name in (
                "checkpoints/step-7/COMMITTED", "checkpoints/step-7/state.pt", "manifest.json", "result.txt")]
        assert json.loads(fs.cat(f"{S3_BUCKET}/rerunjob/out/manifest.json"))["status"] == "completed"
        assert fs.cat(f"{S3_BUCKET}/rerunjob/out/result.txt") == b"made while the store was down\n"
        assert not (job_scratch / "return-pending.json").exists() and not (job_scratch / "output").exists()
    finally:
        store2.stop()


def test_kept_output_removed_is_never_delivered_as_failed(e31, tmp_path, prefect_api, scratch):
    """Someone removed the kept output: `e31 return` refuses (exit 1), sends
    nothing and keeps the record; a job name that is a path is refused; a
    new run of the job drops the record with a warning and runs the work
    again."""
    from tests.conftest import S3_BUCKET, S3_KEY
    from tests.s3server import S3Server

    spec, job_scratch = _run_while_destination_dies(e31, tmp_path, scratch, "gonejob")
    (job_scratch / "output" / "result.txt").unlink()
    store2 = S3Server(tmp_path / "store2", key=S3_KEY, secret=S3_SECRET, bucket=S3_BUCKET).start()
    try:
        back = e31("return", "gonejob", env=store2.env())
        assert back.returncode == 1
        assert back.stderr == (
            f"e31: cannot return the output of gonejob: the output kept in {job_scratch / 'output'} for "
            f"s3://{S3_BUCKET}/gonejob/out/ is gone (missing or changed: result.txt); nothing was delivered; run "
            f"the job again to produce it anew (that drops {job_scratch / 'return-pending.json'})\n")
        fs = store2.filesystem()
        assert not fs.exists(f"{S3_BUCKET}/gonejob/out/manifest.json")
        assert (job_scratch / "return-pending.json").exists()
        for bad in ("../gonejob", str(job_scratch), "a/b"):
            refused = e31("return", bad, env=store2.env())
            assert refused.returncode == 2
            assert refused.stderr == (f"e31: return: {bad!r} is not a job name (1-63 letters, digits, '.', '_', "
                                      "'-'; the spec's name, not a path)\n")
        assert (job_scratch / "return-pending.json").exists()

        rerun = e31("run", str(spec), env=store2.env())
        assert rerun.returncode == 0, rerun.stderr
        assert (tmp_path / "runs.log").read_text() == "ran\nran\n"
        assert "is gone (missing or changed: result.txt); nothing was delivered; running the job again" in (
            rerun.stderr + rerun.stdout)
        assert json.loads(fs.cat(f"{S3_BUCKET}/gonejob/out/manifest.json"))["status"] == "completed"
        assert not (job_scratch / "return-pending.json").exists()
    finally:
        store2.stop()
