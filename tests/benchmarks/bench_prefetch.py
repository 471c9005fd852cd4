"""Benchmark: prefetch (staging a queued job's inputs before its allocation) against none.

    python tests/benchmarks/bench_prefetch.py [--jobs 10] [--size 1GiB] [--nodes 2] [--work-s 15]

Starts its own ``prefect server start`` (SQLite, 127.0.0.1) and S3 server
(SeaweedFS ``weed mini``, :mod:`tests.s3server`), puts ``--jobs`` distinct
objects of ``--size`` bytes there, and runs the same queue twice, each time
with a fresh pool, fresh scratch folders, ``e31 scheduler`` and one ``e31
worker`` per node (one job at a time per node): first **without** prefetch
(no ``scratch_budget``), then **with** it (``scratch_budget`` 2x the inputs).
Every job reads its own object and then works ``--work-s`` seconds
(a sleep).  All jobs are submitted at once.

Printed for each run, and as ratios:

- **resource-seconds held**: per job, from its ``Placed`` state (its node's
  slot is taken) to its flow run's final state, summed (target: with
  prefetch, less by at least the in-run staging time saved);
- the **meter** (manifest ``meter.cpu_seconds``: the work's start to its release, no staging);
- **in-run staging** seconds (manifest ``timings.staging_s``) summed, and
  ``timings.prefetch_s`` summed (staging done before allocation);
- the rest of the held time (held less in-run staging, work, settle and
  return: the flow processes' start and end, the same work in both runs);
- **wall**: first submission to last final state (target: the same or less);
- **a running job's own staging beside a prefetch**: the in-run staging
  rate of the jobs that staged in their run (the first ones) with prefetch
  against without (a prefetch pauses while a run on its node stages or
  returns; ratio ~1.0 means it did not slow them).

Stopped (SIGTERM, Ctrl-C) or failing, it stops everything it started (both
servers, the schedulers, the workers, their flow processes and works) and
removes its temporary folder (kept with ``--keep``), then exits; 143 or 130
after a signal (``tests/benchmarks/cleanup.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from e31.specs.units import parse_memory
from e31.prefect_compat.api import api_ready

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.benchmarks.cleanup import Cleanup, active, spawn  # noqa: E402
from tests.benchmarks.server import start_server  # noqa: E402


WORK = ("import os, pathlib, sys, time; time.sleep(float(sys.argv[1])); "
        "pathlib.Path(os.environ['E31_OUTPUT_DIR'], 'done.txt').write_text('done')")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--size", default="1GiB", help="bytes each job reads (a size such as 1GiB)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--work-s", type=float, default=15.0)
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, scratch, outputs)")
    args = parser.parse_args()
    from tests.s3server import seaweed

    with Cleanup("bench_prefetch") as cleanup:  # the store, two scratch copies per node and the outputs: ~3x
        root = cleanup.tempdir("e31-bench-prefetch-", keep=args.keep)  # --jobs x --size
        api, env, server = start_server(root)
        with seaweed(root / "seaweed", key="benchkey", secret="bench-secret", bucket="bench") as s3:
            cleanup.adopt(s3.proc, server=True)
            os.environ.update(s3.env())
            env.update(s3.env())
            while not api_ready(api):
                time.sleep(0.5)
            return _bench(args, root, env, s3)


def _bench(args, root: Path, env: dict, s3) -> int:
    size = parse_memory(args.size)
    local = root / "blob.bin"
    with open(local, "wb") as f:  # one random block repeated: the objects are distinct keys, not distinct bytes
        block = os.urandom(2**24)
        for _ in range(size // len(block)):
            f.write(block)
        f.write(block[:size % len(block)])
    fs = s3.filesystem()
    started = time.monotonic()
    urls = []
    for i in range(args.jobs):
        urls.append(f"s3://{s3.bucket}/inputs/in-{i:02d}.bin")
        fs.put_file(str(local), urls[-1])
    local.unlink()
    print(f"inputs: {args.jobs} objects of {size / 2**30:.2f} GiB put in {time.monotonic() - started:.0f} s; "
          f"{args.nodes} nodes, one job at a time each, work {args.work_s:g} s per job")
    results = {}
    for mode in ("without", "with"):
        results[mode] = _queue(args, root / mode, env, urls, size, prefetch=mode == "with")
        r = results[mode]
        print(f"{mode:>7} prefetch: held {r['held']:.1f} resource-s, meter {r['meter']:.1f} cpu-s, in-run staging "
              f"{r['staging']:.1f} s ({r['staged_in_run']} jobs), prefetch {r['prefetch']:.1f} s "
              f"({r['prefetched']} jobs), wall {r['wall']:.1f} s; held beyond staging, work and return "
              f"{r['held'] - r['in_run']:.1f} s (starting the flow processes, Placed to Running, "
              f"{r['starting']:.1f} s; the rest in the flow runs and their ends)")
    a, b = results["without"], results["with"]
    saved_staging = a["staging"] - b["staging"]
    saved_held = a["held"] - b["held"]
    print(f"resource-seconds held: with {b['held']:.1f} / without {a['held']:.1f} = {b['held'] / a['held']:.3f}; "
          f"saved {saved_held:.1f} s against {saved_staging:.1f} s of in-run staging saved   target saved >= staging "
          f"saved: {'met' if saved_held >= saved_staging else 'missed'}")
    print(f"meter: with {b['meter']:.1f} / without {a['meter']:.1f} = {b['meter'] / a['meter']:.3f}")
    print(f"wall: with {b['wall']:.1f} s / without {a['wall']:.1f} s = {b['wall'] / a['wall']:.3f}   target <= 1.0: "
          f"{'met' if b['wall'] <= a['wall'] else 'missed'}")
    if a["rates"] and b["rates"]:
        ra, rb = statistics.median(a["rates"]), statistics.median(b["rates"])
        print(f"in-run staging rate of the jobs that staged in their run: with prefetch {rb / 2**20:.0f} MiB/s, "
              f"without {ra / 2**20:.0f} MiB/s: ratio {rb / ra:.2f} (1.0: a prefetch did not slow them)")
    return 0


def _queue(args, root: Path, env: dict, urls: list[str], size: int, prefetch: bool) -> dict:
    from prefect.client.orchestration import get_client

    root.mkdir(parents=True)
    name = f"bench-{root.name}"
    node = {"name": "n", "count": args.nodes, "cpus": 1, "memory": "1GiB"}
    if prefetch:
        node["scratch_budget"] = 2 * size * len(urls)
    pool_file = root / "pool.yaml"
    pool_file.write_text(json.dumps({"pool_version": 1, "name": name, "nodes": [node]}))
    exe = str(Path(sys.executable).with_name("e31"))
    procs = [spawn([exe, "scheduler", "--pool", str(pool_file), "--interval", "0.5"], env=env,
                   stdout=open(root / "scheduler.log", "wb"), stderr=subprocess.STDOUT)]
    for i in range(1, args.nodes + 1):
        node = f"n-{i}" if args.nodes > 1 else "n"  # a pool's single node is named n
        procs.append(spawn([exe, "worker", "--pool", str(pool_file), "--node", node],
                           env={**env, "E31_SCRATCH": str(root / f"scratch-{i}")},
                           stdout=open(root / f"worker-{i}.log", "wb"), stderr=subprocess.STDOUT))
    try:
        time.sleep(8)  # the scheduler has made the work pool; the workers answer
        jobs = []
        for i, url in enumerate(urls):
            spec = root / f"job-{i:02d}.yaml"
            spec.write_text(json.dumps({
                "name": f"{root.name}-{i:02d}", "data": [{"name": "in", "url": url}],
                "work": {"kind": "simulation", "command": [sys.executable, "-c", WORK, str(args.work_s)]},
                "request": {"cpus": 1, "duration": f"{args.work_s + 20:g}s", "limit": "30m"},
                "output": {"kind": "results", "url": str(root / "out" / f"{i:02d}"), "files": ["done.txt"]}}))
            jobs.append(spec)
        t0 = time.time()
        ids = []
        for spec in jobs:
            done = subprocess.run([exe, "submit", str(spec), "--pool", str(pool_file)], env=env, capture_output=True,
                                  text=True)
            if done.returncode:
                raise SystemExit(f"e31 submit failed: {done.stderr}")
            ids.append(done.stdout.split("flow run ")[1].split()[0])
        with get_client(sync_client=True) as client:
            while True:
                runs = [client.read_flow_run(k) for k in ids]
                if all(r.state is not None and r.state.is_final() for r in runs):
                    break
                if time.time() - t0 > 3600:
                    raise SystemExit("gave up after an hour")
                time.sleep(2)
            held, end, starting = 0.0, 0.0, 0.0
            for run in runs:
                states = client.read_flow_run_states(str(run.id))
                placed = next(s.timestamp.timestamp() for s in states if s.name == "Placed")
                running = next(s.timestamp.timestamp() for s in states if s.type.value == "RUNNING")
                final = states[-1].timestamp.timestamp()
                held += final - placed
                starting += running - placed
                end = max(end, final)
    finally:  # this run's services end before the next run starts
        for proc in procs:
            active().stop_group(proc)
    manifests = [json.loads((root / "out" / f"{i:02d}" / "manifest.json").read_text()) for i in range(len(urls))]
    bad = [m["status"] for m in manifests if m["status"] != "completed"]
    if bad:
        raise SystemExit(f"jobs did not complete: {bad}")
    in_run = [m for m in manifests if not m["staged_before_allocation"]]
    return {"held": held, "starting": starting, "wall": end - t0, "meter": sum(m["meter"]["cpu_seconds"] for m in manifests),
            "staging": sum(m["timings"]["staging_s"] for m in manifests), "staged_in_run": len(in_run),
            "in_run": sum(m["timings"][k] for m in manifests for k in ("staging_s", "run_s", "settle_s", "return_s")),
            "prefetch": sum(m["timings"]["prefetch_s"] for m in manifests),
            "prefetched": sum(1 for m in manifests if m["timings"]["prefetch_s"] > 0),
            "rates": [size / m["timings"]["staging_s"] for m in in_run if m["timings"]["staging_s"] > 0]}


if __name__ == "__main__":
    sys.exit(main())
