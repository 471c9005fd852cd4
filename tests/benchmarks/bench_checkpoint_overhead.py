"""Benchmark: checkpoint overhead of the example training.

    python tests/benchmarks/bench_checkpoint_overhead.py [--repeat N] [--epochs E]

The example work (``e31.examples.digits:train``, one torch thread) runs as E31
runs it -- a child process (``python -m tasks.child``) whose checkpoints a
supervisor (this process) commits with fsync and a marker every 0.2 s, the
newest only, as the run task does -- once with a checkpoint after every epoch and once with none but the
final one, alternating.  The time compared is the training loop's own
(``train_s`` in metrics.json), so process start-up is left out of both.
Prints the medians and their ratio (target: at most 1.05), and, for
reference, the same in one process with commits done inline
(:meth:`e31.tasks.work.context.WorkContext.local`).  ``--job`` adds the whole job
under ``e31 run`` against a ``prefect server start`` it starts (wall time,
checkpoints uploaded by checkpoint tasks included).
Stopped (SIGTERM, Ctrl-C) or failing, it stops what it started and removes
its temporary folder, then exits; 143 or 130 after a signal
(``tests/benchmarks/cleanup.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from e31.tasks.work.local_checkpoints import commit_pending
from e31.tasks.work.context import ChildConfig

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the repository's tests package
    sys.path.insert(0, str(REPO))
from tests.benchmarks.cleanup import Cleanup, active  # noqa: E402

HIDDEN = [64]  # the example's hidden units; --hidden changes it
DIGITS = Path(__file__).resolve().parents[2] / "specs" / "examples" / "data" / "digits.csv.gz"


def _supervised(root: Path, every: int | None, epochs: int) -> float:
    run = Path(tempfile.mkdtemp(dir=root))
    cfg = ChildConfig(
        entrypoint="e31.examples.digits:train", command=None, params={"epochs": epochs, "hidden": HIDDEN[0]}, data={"digits": str(DIGITS)},
        output_dir=str(run / "out"), checkpoint_dir=str(run / "ck"), progress_file=str(run / "progress.json"),
        device="cpu", cpus=1, gpus=0, checkpoint_every_steps=every, supervised=True,
    )
    cfg.write(run / "child.json")
    proc = subprocess.Popen([sys.executable, "-m", "e31.tasks.work.child", str(run / "child.json")], env={"OMP_NUM_THREADS": "1", "PATH": ""})
    while proc.poll() is None:
        commit_pending(run / "ck", newest_only=True)
        time.sleep(0.2)
    commit_pending(run / "ck", newest_only=True)
    if proc.returncode != 0:
        sys.exit(f"training failed with exit code {proc.returncode}")
    return json.loads((run / "out" / "metrics.json").read_text())["train_s"]


def _inline(root: Path, every: int | None, epochs: int) -> float:
    import torch

    from e31.examples.digits import train
    from e31.tasks.work.context import WorkContext

    torch.set_num_threads(1)
    ctx = WorkContext.local({"digits": DIGITS}, Path(tempfile.mkdtemp(dir=root)), {"epochs": epochs, "hidden": HIDDEN[0]}, checkpoint_every_steps=every)
    return train(ctx)["train_s"]


def _job(root: Path, every: int, url: str) -> float:
    import os

    out = Path(tempfile.mkdtemp(dir=root))
    env = {**os.environ, "PREFECT_API_URL": url, "E31_SCRATCH": str(out / "scratch"), "PREFECT_LOGGING_LEVEL": "WARNING"}
    spec = Path(__file__).resolve().parents[2] / "specs" / "examples" / "digits-nightly-retrain.yaml"
    cmd = [str(Path(sys.executable).with_name("e31")), "run", str(spec), "--set", f"output.url={out / 'out'}",
           "--set", f"output.checkpoint.every_steps={every}", "--set", f"work.params.hidden={HIDDEN[0]}"]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    return time.perf_counter() - started


def main() -> None:
    with Cleanup("bench_checkpoint_overhead"):
        _main()


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=64, help="hidden units (the example's: 64)")
    parser.add_argument("--job", action="store_true", help="also time the whole job under e31 run")
    args = parser.parse_args()
    HIDDEN[0] = args.hidden
    root = active().tempdir("e31-bench-ckpt-")
    print(f"example training, {args.epochs} epochs, hidden {args.hidden}, median of {args.repeat} (training loop seconds)")
    for label, fn in (("child process + committing supervisor (as E31 runs it)", _supervised),
                      ("one process, commit inline (WorkContext.local)", _inline)):
        fn(root, None, 3)  # warm-up
        none, every = [], []
        for _ in range(args.repeat):
            none.append(fn(root, None, args.epochs))
            every.append(fn(root, 1, args.epochs))
        a, b = statistics.median(none), statistics.median(every)
        print(f"{label}:")
        print(f"  {'no checkpoints (final only)':34s} {a:7.3f} s   1.00x")
        print(f"  {'checkpoint every epoch':34s} {b:7.3f} s   {b / a:5.3f}x   (target <= 1.05)")
    if args.job:
        from tests.benchmarks.bench_example_job import _start_server

        proc, url = _start_server(root / "prefect-home")
        try:
            _job(root, 1000, url)  # warm-up
            none = [_job(root, 1000, url) for _ in range(args.repeat)]
            every = [_job(root, 1, url) for _ in range(args.repeat)]
        finally:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        a, b = statistics.median(none), statistics.median(every)
        print("whole job under e31 run (wall seconds, running Prefect server):")
        print(f"  {'final checkpoint only':34s} {a:7.3f} s   1.00x")
        print(f"  {'checkpoint every epoch':34s} {b:7.3f} s   {b / a:5.3f}x")
    size = [p.stat().st_size for p in root.rglob("state.pt")]
    print(f"checkpoint size {statistics.median(size) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
