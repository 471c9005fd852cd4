"""The work's child started before its inputs stage (e31.tasks.supervisor.warm):
it loads while the run gets ready, then runs with exactly what a child
started at the run's beginning would have (staged inputs in its variables
and ``ctx.data``, the output folder as its working folder); a run that never
starts its work leaves no waiting child behind."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from e31.flows.job import run_job
from e31.specs import parse_spec
from e31.tasks.stage import StageError

WORK = textwrap.dedent("""
    import json, os, time
    LOADED_AT = time.time()  # when the module was imported: before the inputs were staged

    def run(ctx):
        (ctx.output_dir / "seen.json").write_text(json.dumps({
            "loaded_at": LOADED_AT, "begun_at": time.time(), "cwd": os.getcwd(),
            "env_data": os.environ.get("E31_DATA_INP"), "ctx_data": str(ctx.data["inp"]),
            "text": (ctx.data["inp"] / "in.txt").read_text() if ctx.data["inp"].is_dir() else ctx.data["inp"].read_text(),
            "pid": os.getpid()}))
""")


def _spec(tmp_path: Path, name: str, data_url: str) -> dict:
    (tmp_path / "prework.py").write_text(WORK)
    return {"name": name, "work": {"kind": "processing", "entrypoint": "prework:run"},
            "data": [{"name": "inp", "url": data_url}], "request": {"limit": "2m", "grace": "2s"},
            "output": {"kind": "results", "url": str(tmp_path / "out"), "files": ["seen.json"]}}


def _processes_of(checkpoint_dir: Path) -> list[int]:
    """Pids of live processes whose environment names ``checkpoint_dir``."""
    mark = f"E31_CHECKPOINT_DIR={checkpoint_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_the_prestarted_child_runs_with_the_staged_inputs_in_its_output_folder(prefect_api, scratch, tmp_path):
    (tmp_path / "in.txt").write_text("staged text")
    manifest = run_job(parse_spec(_spec(tmp_path, "prestarted", str(tmp_path / "in.txt"))), code_dir=str(tmp_path))
    seen = json.loads((tmp_path / "out" / "seen.json").read_text())
    staged = scratch / "prestarted" / "data" / "inp" / "in.txt"
    assert manifest["status"] == "completed"
    assert manifest["timings"]["prestart_s"] > 0  # the child was waiting before the run began
    assert seen["cwd"] == str(scratch / "prestarted" / "output")
    assert seen["ctx_data"] == seen["env_data"] == str(staged)
    assert seen["text"] == "staged text"
    # the go came child_start_s before the work's first line; the module was loaded before the work ran
    assert seen["loaded_at"] <= seen["begun_at"]
    assert _processes_of(scratch / "prestarted" / "checkpoints") == []


def test_a_staging_failure_leaves_no_waiting_child(prefect_api, scratch, tmp_path):
    spec = parse_spec(_spec(tmp_path, "prestart-nostage", str(tmp_path / "missing.txt")))
    with pytest.raises(StageError):
        run_job(spec, code_dir=str(tmp_path))
    assert _processes_of(scratch / "prestart-nostage" / "checkpoints") == []
    assert not (tmp_path / "out" / "seen.json").exists()


def test_prestart_can_be_turned_off(prefect_api, scratch, tmp_path, monkeypatch):
    monkeypatch.setenv("E31_PRESTART", "0")
    (tmp_path / "in.txt").write_text("cold")
    manifest = run_job(parse_spec(_spec(tmp_path, "cold-start", str(tmp_path / "in.txt"))), code_dir=str(tmp_path))
    assert manifest["status"] == "completed" and "prestart_s" not in manifest["timings"]
    assert json.loads((tmp_path / "out" / "seen.json").read_text())["text"] == "cold"
    assert os.environ["E31_PRESTART"] == "0"


def test_a_module_that_reads_its_inputs_at_import_is_loaded_again_after_the_go(prefect_api, scratch, tmp_path):
    """A module reading ``E31_DATA_*`` at import fails in the prestarted
    child (the inputs are not staged yet); it is imported again once they
    are, and only a second failure is the job's."""
    (tmp_path / "in.txt").write_text("read at import")
    (tmp_path / "eager.py").write_text(textwrap.dedent("""
        import os, pathlib
        TEXT = pathlib.Path(os.environ["E31_DATA_INP"]).read_text()  # KeyError before the go

        def run(ctx):
            (ctx.output_dir / "seen.json").write_text(TEXT)
    """))
    spec = _spec(tmp_path, "eager-import", str(tmp_path / "in.txt"))
    spec["work"]["entrypoint"] = "eager:run"
    manifest = run_job(parse_spec(spec), code_dir=str(tmp_path))
    assert manifest["status"] == "completed"
    assert (tmp_path / "out" / "seen.json").read_text() == "read at import"
    assert manifest["logs"]["stderr_tail"] == ""  # the first, early failure is not the work's to see


def test_a_bad_entrypoint_still_fails_with_exit_code_2_and_says_why(prefect_api, scratch, tmp_path):
    from e31.flows.job import JobFailedError

    (tmp_path / "in.txt").write_text("x")
    spec = _spec(tmp_path, "bad-entry", str(tmp_path / "in.txt"))
    spec["work"]["entrypoint"] = "prework:nope"
    with pytest.raises(JobFailedError) as err:
        run_job(parse_spec(spec), code_dir=str(tmp_path))
    manifest = err.value.manifest
    assert (manifest["status"], manifest["exit_code"]) == ("failed", 2)
    assert manifest["logs"]["stderr_tail"] == ("e31: cannot load work.entrypoint 'prework:nope': AttributeError: "
                                               "module 'prework' has no attribute 'nope'")


def test_the_quick_exit_keeps_what_the_work_left_to_threads_and_open_files(prefect_api, scratch, tmp_path):
    """The child ends without the interpreter's teardown, but joins the
    work's threads and flushes its open files first, as that teardown would."""
    (tmp_path / "in.txt").write_text("x")
    (tmp_path / "late.py").write_text(textwrap.dedent("""
        import threading, time
        OPEN = []

        def run(ctx):
            fh = open(ctx.output_dir / "buffered.txt", "w")
            fh.write("kept" * 1000)  # never closed: held by the module
            OPEN.append(fh)

            def finish():
                time.sleep(0.5)
                (ctx.output_dir / "late.txt").write_text("written after the function returned")

            threading.Thread(target=finish).start()
    """))
    spec = _spec(tmp_path, "late-writes", str(tmp_path / "in.txt"))
    spec["work"]["entrypoint"] = "late:run"
    spec["output"]["files"] = ["buffered.txt", "late.txt"]
    manifest = run_job(parse_spec(spec), code_dir=str(tmp_path))
    assert manifest["status"] == "completed"
    assert (tmp_path / "out" / "buffered.txt").read_text() == "kept" * 1000
    assert (tmp_path / "out" / "late.txt").read_text() == "written after the function returned"
