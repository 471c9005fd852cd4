"""Benchmark: stop latency -- seconds from the stop warning to a partial
manifest at the destination, less the grace period.

    python tests/benchmarks/bench_stop_latency.py [--state-mib M] [--grace S]

Runs ``e31 run`` of a job whose work (``tests/flows/stopwork.py``) commits a
checkpoint of ``M`` MiB each step, with a time limit that stops it, twice:
work that saves and returns when warned, and work that ignores the warning
(killed at the end of the grace period).  Latency is the manifest's mtime
minus ``stop_requested_at`` from the manifest, less the grace period.  The
baseline is ``cp`` of the same bytes (the returned checkpoint and files) to a
fresh folder, in the same run; the target is latency - grace <= 2 s + cp.
Stopped (SIGTERM, Ctrl-C) or failing, it stops what it started and removes
its temporary folder, then exits; 143 or 130 after a signal
(``tests/benchmarks/cleanup.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the repository's tests package
    sys.path.insert(0, str(REPO))
from tests.benchmarks.cleanup import Cleanup, active  # noqa: E402

WORK = REPO / "tests" / "flows"


def _job(root: Path, name: str, args, **params) -> dict:
    return {
        "name": name,
        "work": {"kind": "simulation", "entrypoint": "stopwork:steps",
                 "params": {"step_s": 0.2, "state_mib": args.state_mib, **params}},
        "request": {"limit": f"{args.limit}s", "grace": f"{args.grace}s"},
        "output": {"kind": "results", "url": str(root / f"out-{name}"), "files": ["done.txt"]},
    }


def _measure(root: Path, spec: dict) -> tuple[float, int, float]:
    path = root / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "E31_SCRATCH": str(root / "scratch"), "PYTHONPATH": str(WORK),
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    result = subprocess.run([str(Path(sys.executable).with_name("e31")), "run", str(path)], capture_output=True,
                            text=True, env=env)
    if result.returncode != 3:
        sys.exit(f"expected a partial run (exit 3), got {result.returncode}:\n{result.stderr[-2000:]}")
    out = Path(spec["output"]["url"])
    manifest = json.loads((out / "manifest.json").read_text())
    latency = (out / "manifest.json").stat().st_mtime - manifest["stop_requested_at"]
    returned = [out / f["path"] for f in manifest["files"]]
    returned += sorted(Path(manifest["checkpoint"]).iterdir()) if manifest.get("checkpoint") else []
    size = sum(p.stat().st_size for p in returned)
    target = root / f"cp-{spec['name']}"
    target.mkdir()
    started = time.perf_counter()
    subprocess.run(["cp", *map(str, returned), str(target)], check=True)
    subprocess.run(["sync", "-f", str(target)], check=True)
    return latency, size, time.perf_counter() - started


def main() -> None:
    with Cleanup("bench_stop_latency"):
        _main()


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mib", type=float, default=64.0, help="checkpoint size in MiB (default 64)")
    parser.add_argument("--grace", type=float, default=3.0, help="grace period, seconds (default 3)")
    parser.add_argument("--limit", type=float, default=12.0, help="time limit, seconds (default 12)")
    args = parser.parse_args()
    root = active().tempdir("e31-bench-stop-")
    print(f"stop latency, checkpoint {args.state_mib:g} MiB, grace {args.grace:g} s, limit {args.limit:g} s")
    print(f"{'case':36s} {'latency':>8s} {'- grace':>8s} {'bytes':>12s} {'cp+sync':>8s} {'target':>8s}")
    for label, params in (("work saves and returns when warned", {}),
                          ("work ignores the warning (killed)", {"ignore_stop": True})):
        name = "cooperative" if not params else "ignores"
        latency, size, cp_s = _measure(root, _job(root, name, args, **params))
        over = latency - args.grace
        print(f"{label:36s} {latency:7.2f}s {over:7.2f}s {size:12,d} {cp_s:7.2f}s {2 + cp_s:7.2f}s"
              f"   ratio {(over) / (2 + cp_s):5.2f}")


if __name__ == "__main__":
    main()
