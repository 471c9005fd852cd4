"""The work's own stdout and stderr reach the flow run's log (the Prefect
UI) and the terminal under ``e31 run``, rate-limited and masked, with their
last lines in the manifest and the full files in scratch."""

from __future__ import annotations

import json
import sys
import textwrap

WORK = textwrap.dedent("""
    import os, sys
    print("hello from the work", flush=True)
    print("token is " + os.environ["MY_API_TOKEN"], flush=True)
    print("a warning on stderr", file=sys.stderr, flush=True)
    for i in range(int(os.environ.get("FLOOD", "0"))):
        print(f"flood line {i}")
    print("the end", flush=True)
    open(os.path.join(os.environ["E31_OUTPUT_DIR"], "done.txt"), "w").write("ok")
""")


def _spec(tmp_path, name: str) -> str:
    (tmp_path / "work.py").write_text(WORK)
    spec = tmp_path / "job.yaml"
    spec.write_text(textwrap.dedent(f"""
        name: {name}
        work: {{kind: processing, command: [{sys.executable}, work.py]}}
        request: {{cpus: 1, limit: 2m}}
        output: {{kind: files, url: {tmp_path / 'out'}, files: [done.txt]}}
    """))
    return str(spec)


def _flow_run_logs(run_id: str, settle_s: float = 60) -> list[str]:
    """The flow run's log lines as the API has them, once they stop arriving
    (the server stores logs a little after the client sends them)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    seen, deadline = -1, time.monotonic() + settle_s
    while True:
        with get_client(sync_client=True) as client:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200)
            offset = len(logs)
            while len(logs) == offset and offset % 200 == 0 and offset:
                more = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])),
                                        limit=200, offset=offset)
                logs += more
                offset += 200
        if len(logs) == seen or time.monotonic() > deadline:
            return [log.message for log in logs]
        seen = len(logs)
        time.sleep(2)


def test_print_reaches_the_terminal_and_the_flow_run_log_masked(e31, tmp_path, prefect_api, scratch):
    secret = "tok-PLANTED-9f8e7d"
    result = e31("run", _spec(tmp_path, "printer"), env={"E31_SCRATCH": str(scratch), "MY_API_TOKEN": secret,
                                                          "PREFECT_LOGGING_LEVEL": "INFO"})
    assert result.returncode == 0, result.stderr
    terminal = result.stdout + result.stderr
    assert "hello from the work" in terminal and "[stderr] a warning on stderr" in terminal
    assert "token is ***" in terminal and secret not in terminal
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["logs"] == {"stdout_tail": "hello from the work\ntoken is ***\nthe end",
                                "stderr_tail": "a warning on stderr", "lines_not_forwarded": 0}
    logs = _flow_run_logs(manifest["run_id"])
    assert "hello from the work" in logs and "token is ***" in logs and "[stderr] a warning on stderr" in logs
    assert not [line for line in logs if secret in line]
    assert (scratch / "printer" / "run" / "stdout.log").read_text().count(secret) == 1  # the full record, in scratch


def test_a_flood_of_output_is_rate_limited_and_kept_whole_in_scratch(e31, tmp_path, prefect_api, scratch):
    result = e31("run", _spec(tmp_path, "flooder"), env={"E31_SCRATCH": str(scratch), "MY_API_TOKEN": "x",
                                                          "FLOOD": "200000", "PREFECT_LOGGING_LEVEL": "INFO"})
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    dropped = manifest["logs"]["lines_not_forwarded"]
    assert dropped > 190_000  # at most a burst of 500 lines and 50 lines/s were forwarded
    assert manifest["logs"]["stdout_tail"].splitlines()[-2:] == ["flood line 199999", "the end"]
    work_lines = {"hello from the work", "token is x", "[stderr] a warning on stderr", "the end"}
    logs = _flow_run_logs(manifest["run_id"])
    forwarded = [line for line in logs if line.startswith("flood line") or line in work_lines]
    assert len(forwarded) == 200_004 - dropped  # every line either forwarded or counted
    terminal = (result.stdout + result.stderr).splitlines()
    assert sum("flood line" in line for line in terminal) == sum(line.startswith("flood") for line in forwarded)
    assert any("line(s) of the work's output not forwarded (more than 50 lines/s)" in line for line in terminal)
    lines = (scratch / "flooder" / "run" / "stdout.log").read_text().splitlines()
    assert len(lines) == 200_003 and lines[-1] == "the end"  # kept whole in scratch
