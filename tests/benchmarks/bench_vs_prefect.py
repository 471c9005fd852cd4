"""Benchmark: ``e31 run`` of the example job against the same job written
by hand as a plain Prefect flow, side by side in one run.

    python tests/benchmarks/bench_vs_prefect.py [--pairs N] [--only warm|none] [--count-api]

The baseline is ``tests/benchmarks/handwritten_flow.py`` (stage, train in
process with a checkpoint every epoch on one torch thread, return; fsspec
for the copies).  Both sides run as whole processes, alternating, ``N``
pairs (default 5); each side keeps its scratch between runs (E31 reuses its
staged copy, as a nightly job would) and writes to a fresh output folder.
Two set-ups: a warm ``prefect server start`` this script starts (both sides
use it), and no API configured (each process gets Prefect's temporary
server).  Prints medians, the ratio, and where E31's time went (medians):
CLI start to the flow run's start, staging, child start, work, checkpoint
settle, return, and flow end to exit, from the manifest's ``timings`` and
the flow run's times on the API.  ``--count-api`` adds one more run of each
side with its Prefect API calls counted (HTTP requests by route, events
sent).  Targets (issue "Per-job overhead"):
warm-server ratio at most 1.05; no API at most the baseline + 1 s.
Stopped (SIGTERM, Ctrl-C) or failing, it stops what it started and removes
its temporary folder, then exits; 143 or 130 after a signal
(``tests/benchmarks/cleanup.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.benchmarks.bench_example_job import _start_server as _server  # noqa: E402
from tests.benchmarks.cleanup import Cleanup  # noqa: E402
SPEC = REPO / "specs" / "examples" / "digits-nightly-retrain.yaml"
DIGITS = REPO / "specs" / "examples" / "data" / "digits.csv.gz"
HANDWRITTEN = Path(__file__).with_name("handwritten_flow.py")


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(start, end, seconds) of one whole process; exits on failure."""
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    end = time.time()
    if done.returncode != 0:
        sys.exit(f"benchmark command failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
    return start, end, end - start


def _flow_run_times(url: str, run_id: str) -> tuple[float, float] | None:
    """(start, end) Unix seconds of a flow run, from the API at ``url``."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
    if run.start_time is None or run.end_time is None:
        return None
    return run.start_time.timestamp(), run.end_time.timestamp()


def _latest_handwritten(url: str) -> tuple[float, float] | None:
    """(start, end) of the newest flow run of the hand-written flow."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["handwritten-digits"])),
                                     sort=FlowRunSort.START_TIME_DESC, limit=1)
    if not runs or runs[0].start_time is None or runs[0].end_time is None:
        return None
    return runs[0].start_time.timestamp(), runs[0].end_time.timestamp()


def _breakdown(start: float, end: float, manifest: dict, times: tuple[float, float] | None) -> dict[str, float]:
    """Where one ``e31 run`` went, in seconds."""
    t = manifest["timings"]
    finished = datetime.fromisoformat(manifest["finished_at"]).timestamp()  # whole seconds
    row = {"staging": t.get("staging_s", 0.0), "child start (after its go)": t.get("child_start_s", 0.0),
           "work": t.get("work_s", 0.0), "checkpoint settle": t.get("settle_s", 0.0),
           "return": t.get("return_s", 0.0)}
    if times is not None:
        row["CLI start to flow run start"] = times[0] - start
        row["flow run end to exit"] = end - times[1]
    else:
        row["after the manifest to exit (~1 s resolution)"] = max(0.0, end - finished)
    row["rest (flow start/end, supervisor, task runs)"] = (end - start) - sum(row.values())
    row["(child loading before its go, overlapped)"] = t.get("prestart_s", 0.0)
    return row


def _side_by_side(label: str, env: dict[str, str], work: Path, pairs: int, api: str | None) -> dict:
    e31 = str(Path(sys.executable).with_name("e31"))
    e31_env = {**env, "E31_SCRATCH": str(work / "e31-scratch")}
    plain_s, e31_s, rows, hw_rows = [], [], [], []
    for i in range(pairs + 1):  # the first pair warms caches and is not counted
        hw_start, hw_end, p = _run([sys.executable, str(HANDWRITTEN), str(DIGITS), str(work / "hw-scratch"),
                                    str(work / f"hw-out-{label}-{i}")], env)
        hw_times = _latest_handwritten(api) if api and i else None
        if hw_times:
            hw_rows.append({"process start to flow run start": hw_times[0] - hw_start,
                            "flow run": hw_times[1] - hw_times[0], "flow run end to exit": hw_end - hw_times[1]})
        out = work / f"e31-out-{label}-{i}"
        start, end, e = _run([e31, "run", str(SPEC), "--set", f"output.url={out}"], e31_env)
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["status"] == "completed", manifest
        if i == 0:
            continue
        plain_s.append(p)
        e31_s.append(e)
        times = _flow_run_times(api, manifest["run_id"]) if api else None
        rows.append(_breakdown(start, end, manifest, times))
    return {"plain": statistics.median(plain_s), "e31": statistics.median(e31_s),
            "breakdown": {k: statistics.median(r[k] for r in rows) for k in rows[0]},
            "baseline": {k: statistics.median(r[k] for r in hw_rows) for k in hw_rows[0]} if hw_rows else {}}


def _count_api(env: dict[str, str], work: Path) -> dict[str, dict[str, int]]:
    """One run of each side with every process's Prefect API calls counted
    (``apicount/sitecustomize.py``); returns side -> call -> count."""
    counts: dict[str, dict[str, int]] = {}
    for side in ("hand-written", "e31"):
        prefix = work / f"calls-{side}"
        counted = {**env, "E31_BENCH_API_CALLS": str(prefix), "E31_SCRATCH": str(work / "e31-scratch"),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).with_name("apicount")),
                                                               env.get("PYTHONPATH")]))}
        out = work / f"count-out-{side}"
        if side == "e31":
            _run([str(Path(sys.executable).with_name("e31")), "run", str(SPEC), "--set", f"output.url={out}"], counted)
        else:
            _run([sys.executable, str(HANDWRITTEN), str(DIGITS), str(work / "hw-scratch"), str(out)], counted)
        total: dict[str, int] = {}
        for path in work.glob(f"calls-{side}.*.json"):
            for call, n in json.loads(path.read_text())["counts"].items():
                total[call] = total.get(call, 0) + n
        counts[side] = total
    return counts


def _print_counts(counts: dict[str, dict[str, int]]) -> None:
    calls = sorted(set().union(*counts.values()), key=lambda c: -counts["e31"].get(c, 0))
    print("\nPrefect API calls of one job (warm server; HTTP requests by route, events sent):")
    print(f"  {'call':64s} {'hand-written':>12s} {'e31 run':>8s}")
    for call in calls:
        print(f"  {call[:64]:64s} {counts['hand-written'].get(call, 0):12d} {counts['e31'].get(call, 0):8d}")
    print(f"  {'total':64s} {sum(counts['hand-written'].values()):12d} {sum(counts['e31'].values()):8d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5, help="alternating pairs per set-up (default 5)")
    parser.add_argument("--only", choices=("warm", "none"), help="measure one set-up only")
    parser.add_argument("--count-api", action="store_true",
                        help="also count each side's Prefect API calls in one more run (warm server)")
    args = parser.parse_args()
    with Cleanup("bench_vs_prefect") as cleanup:
        _main(args, cleanup.tempdir("e31-bench-vs-prefect-"))


def _main(args: argparse.Namespace, work: Path) -> None:
    base = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    base.update({"PREFECT_LOGGING_LEVEL": "WARNING", "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                 "PREFECT_HOME": str(work / "prefect-home"), "OMP_NUM_THREADS": "1"})
    results, counts = {}, None
    if args.only in (None, "warm"):
        proc, url = _server(work / "server-home")
        try:
            results["warm server"] = _side_by_side("warm", {**base, "PREFECT_API_URL": url}, work, args.pairs, url)
            counts = _count_api({**base, "PREFECT_API_URL": url}, work) if args.count_api else None
        finally:  # before the set-up without an API: it measures an idle machine
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    if args.only in (None, "none"):
        results["no API (temporary server)"] = _side_by_side("none", base, work, args.pairs, None)
    print(f"example job digits-nightly-retrain (30 epochs), {args.pairs} alternating pairs per set-up, medians")
    for label, r in results.items():
        print(f"\n{label}:")
        print(f"  hand-written Prefect flow  {r['plain']:7.2f} s")
        print(f"  e31 run                    {r['e31']:7.2f} s   ratio {r['e31'] / r['plain']:.2f}   "
              f"difference {r['e31'] - r['plain']:+.2f} s")
        if r["baseline"]:
            print("  hand-written flow, where the time went (medians, s):")
            for k, v in r["baseline"].items():
                print(f"    {k:48s} {v:6.2f}")
        print("  e31 run, where the time went (medians, s):")
        for k, v in r["breakdown"].items():
            print(f"    {k:48s} {v:6.2f}")
    if counts:
        _print_counts(counts)


if __name__ == "__main__":
    main()
