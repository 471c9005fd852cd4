"""Benchmark: the example job under ``e31 run`` against the same training
called as a plain Python function, side by side in one run.

    python tests/benchmarks/bench_example_job.py [--repeat N]

Both sides run as fresh processes from the shell, as a user would run them:
the baseline is ``python -c`` calling ``e31.examples.digits.train`` with a plain
:class:`e31.tasks.work.context.WorkContext` (one torch thread, as the job requests);
the E31 side is ``e31 run`` of the example spec with fresh scratch and output
folders.  ``e31 run`` uses the Prefect API in ``PREFECT_API_URL`` when set,
else Prefect starts a temporary local one (its start-up is part of the
measured time; the script reports both set-ups when ``--server`` is given).
Prints wall seconds (best of N) and the ratio.
Stopped (SIGTERM, Ctrl-C) or failing, it stops what it started and removes
its temporary folder, then exits; 143 or 130 after a signal
(``tests/benchmarks/cleanup.py``).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from e31.prefect_compat.api import api_ready

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the repository's tests package
    sys.path.insert(0, str(REPO))
from tests.benchmarks.cleanup import Cleanup, active, spawn  # noqa: E402

SPEC = REPO / "specs" / "examples" / "digits-nightly-retrain.yaml"
DIGITS = REPO / "specs" / "examples" / "data" / "digits.csv.gz"
PLAIN = (
    "import sys, torch; torch.set_num_threads(1);"
    "from e31.tasks.work.context import WorkContext; from e31.examples.digits import train;"
    "m = train(WorkContext.local({'digits': sys.argv[1]}, sys.argv[2]));"
    "assert m['accuracy'] >= 0.95, m"
)


def _timed(cmd: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"benchmark command failed ({result.returncode}): {' '.join(cmd)}\n{result.stderr[-3000:]}")
    return elapsed


def _start_server(home: Path) -> tuple[subprocess.Popen, str]:
    """Start ``prefect server start`` with its home in ``home``, registered
    as a server with the :class:`~tests.benchmarks.cleanup.Cleanup` entered,
    and wait until it answers; returns its process and API URL.  Exits when
    it does not answer within 120 s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    proc = spawn([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                 server=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    for _ in range(240):
        if api_ready(url):
            return proc, url
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    sys.exit("prefect server did not start")


def main() -> None:
    with Cleanup("bench_example_job"):
        _main()


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per side; the best is reported (default 3)")
    parser.add_argument("--server", action="store_true", help="also measure against a running `prefect server start`")
    args = parser.parse_args()
    work = active().tempdir("e31-bench-")
    base_env = {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING", "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    base_env.setdefault("PREFECT_HOME", str(work / "prefect-home"))
    e31 = str(Path(sys.executable).with_name("e31"))

    def plain(i: int) -> float:
        return _timed([sys.executable, "-c", PLAIN, str(DIGITS), str(work / f"plain-{i}")], base_env)

    def e31_run(i: int, env: dict[str, str]) -> float:
        env = {**env, "E31_SCRATCH": str(work / f"scratch-{i}")}
        return _timed([e31, "run", str(SPEC), "--set", f"output.url={work / f'out-{i}'}"], env)

    plain(-1)  # warm-up: page cache for torch and the data
    rows = []
    plain_s = min(plain(i) for i in range(args.repeat))
    local_env = {k: v for k, v in base_env.items() if k != "PREFECT_API_URL"}
    e31_local = min(e31_run(i, local_env) for i in range(args.repeat))
    rows.append(("e31 run (temporary local Prefect API)", e31_local))
    if args.server:
        proc, url = _start_server(work / "server-home")
        try:
            e31_server = min(e31_run(100 + i, {**base_env, "PREFECT_API_URL": url}) for i in range(args.repeat))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        rows.append(("e31 run (running Prefect server)", e31_server))
    if "PREFECT_API_URL" in base_env and not args.server:
        rows.append(("e31 run (PREFECT_API_URL)", min(e31_run(200 + i, base_env) for i in range(args.repeat))))

    print(f"example job: digits-nightly-retrain, 30 epochs, best of {args.repeat}")
    print(f"{'plain Python: python -c train(WorkContext.local(...))':58s} {plain_s:7.2f} s   1.00x")
    for label, seconds in rows:
        print(f"{label:58s} {seconds:7.2f} s  {seconds / plain_s:5.2f}x")


if __name__ == "__main__":
    main()
