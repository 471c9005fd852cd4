"""Benchmark: two tenants on one live 8-GPU node: tenant b takes back what tenant a borrowed.

    python tests/benchmarks/bench_tenants_live.py [--a-jobs 20] [--b-jobs 3] [--b-steps 8]

A real ``prefect server start`` (SQLite), ``e31 scheduler`` and ``e31 worker`` on one node declared
with 8 GPUs (``E31_NODE_GPUS``: this machine has none; the devices are names, the works sleep) and 2
CPUs.  Tenants a and b, each with a quota of 4 GPUs; the pool's ``min_run`` is 3 s.  Tenant a submits
``--a-jobs`` preemptible jobs of 4 GPUs (each a long work that checkpoints every 0.5 s); once two of
them run (a holds all 8 GPUs, 4 of them borrowed) and have run the min_run, tenant b submits
``--b-jobs`` jobs of 4 GPUs (``--b-steps`` steps of 0.5 s).

Printed against the issue's targets: from b's first submission to its work's start (target: at most
the grace, 10 s, plus 10 s); the most GPUs tenant a's works held at once from b's first start to b's
last end, b's jobs queued or running (target: 4, its quota; before b's first start the 4 GPUs a
borrowed are being taken back: the pool's min_run, then a's stop); and tenant b's row of ``e31 usage
--json`` against the sums of b's manifests, in GPU- and CPU-seconds (target: equal).  Stopped (SIGTERM, Ctrl-C) or failing, it stops what it started and
removes its temporary folder (``tests/benchmarks/cleanup.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the repository's tests package
    sys.path.insert(0, str(REPO))
from tests.benchmarks.cleanup import Cleanup  # noqa: E402
from tests.benchmarks.server import start_server  # noqa: E402

from e31.prefect_compat.api import api_ready  # noqa: E402

GRACE_S = 10.0  # request.grace's default
STEPS = """import json, os, pathlib, signal, sys, time
out, ck = pathlib.Path(os.environ["E31_OUTPUT_DIR"]), pathlib.Path(os.environ["E31_CHECKPOINT_DIR"])
resume = os.environ.get("E31_RESUME_DIR") or ""
start = int(pathlib.Path(resume, "step").read_text()) if resume else 0
log = pathlib.Path(sys.argv[2])
with log.open("a") as f:
    f.write(json.dumps({"start": time.time()}) + "\\n")
def stopped(signum, frame):
    with log.open("a") as f:
        f.write(json.dumps({"stopped": time.time()}) + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stopped)
for step in range(start + 1, int(sys.argv[1]) + 1):
    time.sleep(0.5)
    (ck / f"step-{step}").mkdir()
    (ck / f"step-{step}" / "step").write_text(str(step))
    (ck / f"step-{step}" / "COMMITTED").write_text("")
(out / "record.json").write_text(json.dumps({"steps": int(sys.argv[1])}))
with log.open("a") as f:
    f.write(json.dumps({"end": time.time()}) + "\\n")
"""


def _job(root: Path, name: str, steps: int) -> Path:
    spec = root / f"{name}.json"
    spec.write_text(json.dumps({
        "name": name, "work": {"kind": "simulation", "command": [sys.executable, str(root / "steps.py"), str(steps),
                                                                 str(root / f"{name}.jsonl")]},
        "request": {"gpus": 4, "cpus": 1, "duration": f"{steps}s", "limit": "1h", "preemptible": True, "retries": 0},
        "output": {"kind": "results", "url": str(root / "out" / name), "files": ["record.json"],
                   "checkpoint": {"every": "1s"}}}))
    return spec


def _submit(exe: str, spec: Path, pool: Path, root: Path, tenant: str) -> float:
    at = time.time()
    done = subprocess.run([exe, "submit", str(spec), "--pool", str(pool), "--tenant", tenant], capture_output=True,
                          text=True, cwd=root)
    if done.returncode != 0:
        raise SystemExit(f"bench_tenants_live: e31 submit failed: {done.stderr.strip()}")
    return at


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(predicate, timeout: float, what: str, root: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            said = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                           for p in sorted(root.glob("*.log"))) if root is not None else ""
            raise SystemExit(f"bench_tenants_live: {what} not reached in {timeout:g} s{said}")
        time.sleep(0.2)


def _intervals(lines: list[dict], until: float) -> list[tuple[float, float]]:
    """A work's runs as (start, end) from its log lines; a run still going ends at ``until``."""
    out, began = [], None
    for line in lines:
        if "start" in line:
            began = line["start"]
        elif began is not None:
            out.append((began, line.get("stopped", line.get("end"))))
            began = None
    if began is not None:
        out.append((began, until))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a-jobs", type=int, default=20)
    parser.add_argument("--b-jobs", type=int, default=3)
    parser.add_argument("--b-steps", type=int, default=8)
    args = parser.parse_args(argv)
    exe = str(Path(sys.executable).with_name("e31"))
    with Cleanup("bench_tenants_live") as cleanup:
        root = cleanup.tempdir("e31-bench-tenants-")
        (root / "steps.py").write_text(STEPS)
        url, env, _ = start_server(root)
        pool = root / "pool.json"
        pool.write_text(json.dumps({"pool_version": 1, "name": "bench-tenants", "preemption": {"min_run": "3s"},
                                    "nodes": [{"name": "n1", "gpus": 8, "cpus": 2, "memory": "8GiB"}],
                                    "tenants": [{"name": "a", "quota": {"gpus": 4}}, {"name": "b", "quota": {"gpus": 4}}]}))
        _wait(lambda: api_ready(url), 120, "the Prefect server")
        logs = {name: open(root / f"{name}.log", "wb") for name in ("scheduler", "worker")}
        cleanup.spawn([exe, "scheduler", "--pool", str(pool), "--interval", "0.5"], cwd=root, env=env,
                      stdout=logs["scheduler"], stderr=subprocess.STDOUT)
        cleanup.spawn([exe, "worker", "--pool", str(pool), "--node", "n1"], cwd=root,
                      env={**env, "E31_NODE_GPUS": "8", "E31_SCRATCH": str(root / "scratch")},
                      stdout=logs["worker"], stderr=subprocess.STDOUT)
        a_names = [f"a{k:02d}" for k in range(1, args.a_jobs + 1)]
        for name in a_names:
            _submit(exe, _job(root, name, 600), pool, root, "a")
        _wait(lambda: sum(1 for n in a_names if _lines(root / f"{n}.jsonl")) >= 2, 300, "two of a's works running", root)
        time.sleep(3.5)  # past the pool's min_run
        b_names = [f"b{k}" for k in range(1, args.b_jobs + 1)]
        submitted = {name: _submit(exe, _job(root, name, args.b_steps), pool, root, "b") for name in b_names}
        _wait(lambda: all((root / "out" / n / "manifest.json").exists() for n in b_names), 600, "b's jobs' ends", root)
        time.sleep(2)  # b's manifest artifacts, made a moment after the manifests
        used = subprocess.run([exe, "usage", "--pool", str(pool), "--json"], capture_output=True, text=True,
                              cwd=root, env=env)
        now = time.time()
        a_runs = {n: _intervals(_lines(root / f"{n}.jsonl"), now) for n in a_names}
        b_runs = {n: _intervals(_lines(root / f"{n}.jsonl"), now) for n in b_names}
        manifests = {n: json.loads((root / "out" / n / "manifest.json").read_text()) for n in b_names}
        for log in logs.values():
            log.close()
    first = min(submitted.values())
    b_first_start = min(r[0][0] for r in b_runs.values())
    b_last_end = max(r[-1][1] for r in b_runs.values())
    # the most GPUs a's works held at once from b's first submission to its first start (each work 4 GPUs)
    moments = sorted({t for runs in a_runs.values() for s, e in runs for t in (s, e)} | {first})
    most = 0
    for t in moments:
        if first <= t < b_first_start:
            most = max(most, 4 * sum(1 for runs in a_runs.values() for s, e in runs if s <= t < e))
    held_at_first = 4 * sum(1 for runs in a_runs.values() for s, e in runs if s <= first < e)
    row = next((r for r in json.loads(used.stdout)["rows"] if r["key"] == "b"), {}) if used.returncode == 0 else {}
    gpu_s = round(sum(m["meter"]["gpu_seconds"] for m in manifests.values()), 3)
    cpu_s = round(sum(m["meter"]["cpu_seconds"] for m in manifests.values()), 3)
    to_start = b_first_start - first
    print(f"bench_tenants_live: one node of 8 GPUs (declared), tenants a and b with quotas of 4 GPUs; a submitted "
          f"{args.a_jobs} preemptible 4-GPU jobs, then b {args.b_jobs} ({args.b_steps} x 0.5 s)")
    print(f"  {'measure':<62} {'value':>10} {'target':>10}")
    print(f"  {'b: submission to its first work start (s)':<62} {to_start:>10.2f} {'<= ' + format(GRACE_S + 10, 'g'):>10}")
    print(f"  {'a: GPUs held as b submitted (before b: borrowing is allowed)':<62} {held_at_first:>10d} {'':>10}")
    print(f"  {'a: most GPUs held until b first started (4 borrowed, taken back)':<62} {most:>10d} {'':>10}")
    print(f"  {'a: most GPUs held from b first start to b last end':<62} "
          f"{_after(a_runs, b_first_start, b_last_end):>10d} {'<= 4':>10}")
    print(f"  {'e31 usage, tenant b GPU-seconds / the manifests sum':<62} {row.get('gpu_seconds', 'n/a')!s:>10} {gpu_s:>10}")
    print(f"  {'e31 usage, tenant b CPU-seconds / the manifests sum':<62} {row.get('cpu_seconds', 'n/a')!s:>10} {cpu_s:>10}")
    ok = (to_start <= GRACE_S + 10 and _after(a_runs, b_first_start, b_last_end) <= 4 and row.get("gpu_seconds") == gpu_s
          and row.get("cpu_seconds") == cpu_s and row.get("completed") == args.b_jobs)
    print(f"  targets met: {ok}")
    if not ok:  # the works' runs, for the reader
        for name, runs in {**a_runs, **b_runs}.items():
            if runs:
                print(f"  {name}: " + ", ".join(f"{s - first:+.1f}..{e - first:+.1f} s" for s, e in runs))
    return 0 if ok else 1


def _after(a_runs: dict[str, list[tuple[float, float]]], since: float, until: float) -> int:
    """The most GPUs a's works held at once from ``since`` (b's first work start: the reclaim is done) to
    ``until``."""
    moments = sorted({t for runs in a_runs.values() for s, e in runs for t in (s, e)} | {since})
    return max((4 * sum(1 for runs in a_runs.values() for s, e in runs if s <= t < e)
                for t in moments if since <= t <= until), default=0)


if __name__ == "__main__":
    sys.exit(main())
