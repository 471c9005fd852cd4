"""Benchmark: a 2-node job across separate hosts, E31 against the same training started by hand.

    python tests/benchmarks/bench_gang_hosts.py [--steps 400] [--warmup 40] [--rounds 2] [--keep]

Three hosts as Linux network namespaces (:mod:`tests.hosts`; needs root): host 0 runs a Prefect server,
an S3 server (SeaweedFS) and ``e31 scheduler``; hosts 1 and 2 each an ``e31 worker`` for one node of 2
CPUs (the queue of ``tests/deployments/test_hosts.py``).  In one run, on the same hosts:

* **Throughput.** A data-parallel training (``torch.distributed``, gloo over the hosts' bridge: a
  512x512x512 MLP, batch 64, its gradients all-reduced every step, one thread per rank) measures its
  own steps per second after ``--warmup`` steps.  It runs as an E31 job (``request.nodes: 2``, a
  ``command``: the rendezvous comes from E31's environment) and by hand with ``torchrun --nnodes 2``
  on hosts 1 and 2 (``python -m torch.distributed.run``, the lead's address and a fixed port,
  ``GLOO_SOCKET_IFNAME=eth0`` as E31 sets it), alternately, ``--rounds`` times each.  Printed: each
  round's steps/s and the ratio of the best E31 round to the best ``torchrun`` round (the issue's goal:
  >= 0.95).
* **Stop latency.** A training that checkpoints every 10 steps to the object store is stopped by its
  time limit (20 s, grace 5 s); the latency is the time from the warning (the manifest's
  ``stop_requested_at``) to the partial manifest read at the destination (polled every 0.2 s from
  host 0), as a 2-node job and, as the baseline, as a 1-node job of the same work on the same queue.

Stopped (SIGTERM, Ctrl-C) or failing, it stops every process it started, deletes the namespaces and
removes its folder (``tests/benchmarks/cleanup.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the repository's tests package
    sys.path.insert(0, str(REPO))
from tests.benchmarks.cleanup import Cleanup  # noqa: E402

#: The training: the same script under E31 (a ``command`` job) and under ``torchrun``; rank 0 writes its
#: steps per second to ``rate.json`` in the output folder (E31's, else the third argument).
TRAIN = """
import json, os, sys, time
import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps, warmup = int(sys.argv[1]), int(sys.argv[2])
x = torch.randn(64, 512) + rank
started = time.perf_counter()
for step in range(steps):
    if step == warmup:
        started = time.perf_counter()
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
rate = (steps - warmup) / (time.perf_counter() - started)
out = os.environ.get("E31_OUTPUT_DIR") or sys.argv[3]
if rank == 0:
    with open(os.path.join(out, "rate.json"), "w") as fh:
        json.dump({"steps_per_s": rate, "world": world, "master": os.environ["MASTER_ADDR"]}, fh)
dist.destroy_process_group()
"""

TORCHRUN_PORT = 29531


def _wait(predicate, timeout: float, what: str, cluster, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not reached in {timeout:g} s\n{cluster.logs()}")
        time.sleep(every)


def _e31_round(cluster, name: str, steps: int, warmup: int) -> float:
    from tests.deployments.test_hosts import BUCKET

    spec = cluster.root / f"{name}.yaml"
    spec.write_text(json.dumps({
        "name": name, "work": {"kind": "training", "command": [sys.executable, str(cluster.root / "train.py"),
                                                             str(steps), str(warmup)]},
        "request": {"nodes": 2, "cpus": 2, "limit": "10m"},
        "output": {"kind": "results", "url": f"s3://{BUCKET}/{cluster.prefix}/out/{name}/", "files": ["rate.json"]}}))
    cluster.submit(spec)
    # read rarely: each read is an S3 client's work on the machine the ranks share (polled every 0.2 s, it
    # took a third of a core from them)
    _wait(lambda: cluster.manifest(name), 600, f"the output of {name}", cluster, every=3.0)
    manifest = cluster.manifest(name)
    if manifest["status"] != "completed":
        raise RuntimeError(f"{name}: {manifest['status']}: {manifest.get('message')}")
    return json.loads(cluster.get(f"{cluster.prefix}/out/{name}/rate.json"))["steps_per_s"]


def _torchrun_round(cluster, round_: int, steps: int, warmup: int) -> float:
    hosts, out = cluster.hosts, cluster.root / f"torchrun-{round_}"
    out.mkdir()
    procs = []
    for rank, host in enumerate((1, 2)):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(rank), "--master-addr", hosts.address(1), "--master-port", str(TORCHRUN_PORT),
                str(cluster.root / "train.py"), str(steps), str(warmup), str(out)]
        procs.append(hosts.popen(host, argv, env=cluster.env(host, GLOO_SOCKET_IFNAME="eth0"), cwd=cluster.root,
                                 log=f"torchrun-{round_}-{rank}"))
    for proc in procs:
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(f"torchrun exited with {proc.returncode}\n{cluster.logs()}")
    return json.loads((out / "rate.json").read_text())["steps_per_s"]


def _stop_latency(cluster, name: str, nodes: int) -> tuple[float, int]:
    """Seconds from the warning of a time-limited training to its partial manifest at the destination, and
    the step it stopped at."""
    from tests.deployments.test_gang_live import gang_spec
    from tests.deployments.test_hosts import BUCKET

    spec = gang_spec(cluster.root, f"s3://{BUCKET}/{cluster.prefix}/out/{name}/", 100_000, 0.1, name=name,
                     nodes=nodes, cpus=2, limit="20s", grace="5s")
    key = f"{cluster.prefix}/out/{name}/partial/manifest.json"

    def landed() -> dict | None:
        body = cluster.get(key)
        manifest = json.loads(body) if body else None
        return manifest if manifest and manifest.get("status") != "returning" else None

    cluster.submit(spec)
    found: dict = {}

    def poll() -> bool:
        manifest = landed()
        if manifest is not None:
            found.update(manifest, _seen=time.time())
        return manifest is not None

    _wait(poll, 600, f"the partial output of {name}", cluster)
    if found["reason"] != "time_limit":
        raise RuntimeError(f"{name}: {found['status']} ({found['reason']}): {found.get('message')}")
    return found["_seen"] - found["stop_requested_at"], found["step"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the folder (its logs) after the run")
    args = parser.parse_args()

    from tests.deployments.test_hosts import Cluster
    from tests.hosts import Hosts, unavailable

    why = unavailable()
    if why:
        print(f"bench_gang_hosts: cannot run: {why}", file=sys.stderr)
        return 2
    with Cleanup("bench_gang_hosts") as cleanup:
        root = cleanup.tempdir("e31-bench-gang-hosts-", keep=args.keep)
        with Hosts(3, root) as hosts:
            cluster = Cluster(hosts, root, nodes=2)
            try:
                (root / "train.py").write_text(TRAIN)
                print("starting the hosts' Prefect server, S3 server, scheduler and 2 workers ...", flush=True)
                cluster.start()
                e31, torchrun = [], []
                for r in range(args.rounds):
                    e31.append(_e31_round(cluster, f"rate-{r}", args.steps, args.warmup))
                    print(f"round {r + 1}: E31 {e31[-1]:.1f} steps/s", flush=True)
                    torchrun.append(_torchrun_round(cluster, r, args.steps, args.warmup))
                    print(f"round {r + 1}: torchrun {torchrun[-1]:.1f} steps/s", flush=True)
                gang, gang_step = _stop_latency(cluster, "stop-gang", 2)
                single, single_step = _stop_latency(cluster, "stop-single", 1)
            finally:
                for proc in list(hosts.procs):
                    hosts.stop(proc)
                if cluster.s3 is not None:
                    cluster.s3.stop()
    print()
    print(f"2-node gloo training across hosts, {args.steps} steps ({args.warmup} warm-up), steps/s:")
    print(f"  E31 (request.nodes: 2):  {', '.join(f'{v:.1f}' for v in e31)}   best {max(e31):.1f}")
    print(f"  torchrun by hand:        {', '.join(f'{v:.1f}' for v in torchrun)}   best {max(torchrun):.1f}")
    print(f"  E31 / torchrun: best {max(e31) / max(torchrun):.3f}, mean {sum(e31) / len(e31) / (sum(torchrun) / len(torchrun)):.3f}"
          "   (goal >= 0.95)")
    print("stop warning -> partial manifest at the destination (time limit 20 s, grace 5 s):")
    print(f"  2-node job: {gang:.2f} s (stopped at step {gang_step})")
    print(f"  1-node job: {single:.2f} s (stopped at step {single_step})   ratio {gang / single:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
