"""The baseline of ``bench_vs_prefect.py``: the example job written by hand
as a plain Prefect flow, as a user without E31 would write it.

    python tests/benchmarks/handwritten_flow.py DATA_URL SCRATCH OUT_URL

A ``stage`` task copies the CSV into ``SCRATCH`` with fsspec, a ``train``
task calls ``e31.examples.digits.train`` in this process with a local
context that checkpoints every epoch on one CPU thread (the example spec's
request and params), a ``return`` task copies ``model.pt`` and
``metrics.json`` to ``OUT_URL`` with fsspec.  No supervision, no durable
checkpoints, no manifest: what E31's guarantees are measured against.
"""

from __future__ import annotations

import sys
from pathlib import Path

import fsspec
import yaml
from prefect import flow, task

SPEC = Path(__file__).resolve().parents[2] / "specs" / "examples" / "digits-nightly-retrain.yaml"


@task
def stage(url: str, scratch: str) -> str:
    """Copy the input into scratch; returns its local path."""
    local = Path(scratch) / "data" / Path(url).name
    local.parent.mkdir(parents=True, exist_ok=True)
    fs, path = fsspec.core.url_to_fs(url)
    fs.get_file(path, str(local))
    return str(local)


@task
def train(data: str, scratch: str, params: dict) -> dict:
    """The example's training in this process, one torch thread, a local
    checkpoint every epoch."""
    import torch

    from e31.examples.digits import train as digits_train
    from e31.tasks.work.context import WorkContext

    torch.set_num_threads(1)
    ctx = WorkContext.local({"digits": data}, Path(scratch) / "output", params=params,
                            checkpoint_dir=Path(scratch) / "checkpoints", cpus=1, checkpoint_every_steps=1)
    return digits_train(ctx)


@task(name="return")
def give_back(scratch: str, out_url: str) -> list[str]:
    """Copy the declared output files to ``out_url``."""
    fs, root = fsspec.core.url_to_fs(out_url)
    fs.makedirs(root, exist_ok=True)
    sent = []
    for name in ("model.pt", "metrics.json"):
        fs.put_file(str(Path(scratch) / "output" / name), f"{root.rstrip('/')}/{name}")
        sent.append(name)
    return sent


@flow(name="handwritten-digits")
def handwritten(data_url: str, scratch: str, out_url: str) -> list[str]:
    """stage -> train -> return, as tasks of one flow run."""
    params = yaml.safe_load(SPEC.read_text())["work"]["params"]
    local = stage(data_url, scratch)
    metrics = train(local, scratch, params)
    assert metrics["accuracy"] >= 0.95, metrics
    return give_back(scratch, out_url)


if __name__ == "__main__":
    handwritten(*sys.argv[1:4])
