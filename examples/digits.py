"""The nightly-retrain example work: an MLP classifier on the UCI handwritten
digits (1,797 8x8 images, 64 features valued 0..16 plus the label per CSV
row), trained with torch on CPU or CUDA as the context says.

Entry point ``e31.examples.digits:train`` (see
``specs/examples/digits-nightly-retrain.yaml``).  Params (all optional):
``epochs`` (30), ``hidden`` (64 units), ``lr`` (0.01), ``batch_size`` (64),
``seed`` (0), ``holdout`` (fraction held out for the accuracy, 0.2),
``epoch_sleep`` (seconds slept per epoch, to stand in for a longer run in
tests of early stops; 0).

Writes ``model.pt`` (the ``state_dict``, loadable with
``torch.load(weights_only=True)``) and ``metrics.json`` (held-out
``accuracy`` and ``loss``, row counts, and ``train_s``: seconds spent in the
training loop of this attempt).  Commits a checkpoint at the end of each epoch the policy asks
for, with step = epochs done; resumes from the newest one.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

N_FEATURES = 64
N_CLASSES = 10
PIXEL_MAX = 16.0  # the UCI digits' pixel counts run 0..16


def load_digits_csv(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the gzipped CSV: returns ``(x float32 [n, 64] scaled to 0..1,
    y int64 [n])``.  Raises ``ValueError`` for a file of the wrong shape."""
    with gzip.open(path, "rt") as fh:
        table = np.loadtxt(fh, delimiter=",", dtype=np.float32)
    if table.ndim != 2 or table.shape[1] != N_FEATURES + 1:
        raise ValueError(f"{path}: expected {N_FEATURES + 1} columns per row, got shape {table.shape}")
    x = torch.from_numpy(table[:, :N_FEATURES] / PIXEL_MAX)
    y = torch.from_numpy(table[:, N_FEATURES].astype(np.int64))
    return x, y


def split(n: int, holdout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic train/held-out index split of ``n`` rows."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = int(round(n * holdout))
    return order[n_test:], order[:n_test]


def build_model(hidden: int) -> nn.Module:
    """64 -> hidden -> hidden -> 10 MLP with ReLU."""
    return nn.Sequential(
        nn.Linear(N_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, N_CLASSES)
    )


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Held-out ``accuracy`` (0..1) and mean cross-entropy ``loss``."""
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    model.train()
    return {"accuracy": accuracy, "loss": loss}


def train(ctx) -> dict[str, float] | None:
    """Train, checkpoint and write the outputs; see the module docstring.
    Returns the metrics, or None when stopped early."""
    p = {"epochs": 30, "hidden": 64, "lr": 0.01, "batch_size": 64, "seed": 0, "holdout": 0.2, "epoch_sleep": 0.0}
    p.update(ctx.params)
    device = torch.device(ctx.device)
    torch.manual_seed(int(p["seed"]))
    x, y = load_digits_csv(ctx.data["digits"])
    train_idx, test_idx = split(len(y), float(p["holdout"]), int(p["seed"]))
    x_train, y_train = x[train_idx].to(device), y[train_idx].to(device)
    x_test, y_test = x[test_idx].to(device), y[test_idx].to(device)

    model = build_model(int(p["hidden"])).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=float(p["lr"]))
    epochs = int(p["epochs"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    start_epoch = 0
    restored = ctx.restore()
    if restored is not None:
        state, start_epoch = restored
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng_cpu"])

    batch = int(p["batch_size"])
    started = time.perf_counter()
    for epoch in range(start_epoch, epochs):
        # The order of epoch e depends only on (seed, e): a resumed run sees the same batches.
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(int(p["seed"]) * 100_003 + epoch))
        for i in range(0, len(order), batch):
            idx = order[i : i + batch].to(device)
            loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        scheduler.step()
        if p["epoch_sleep"]:
            time.sleep(float(p["epoch_sleep"]))
        done = epoch + 1
        ctx.progress(done, epochs, loss=float(loss.item()))
        if ctx.checkpoint_due(done) or done == epochs:
            ctx.checkpoint(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng_cpu": torch.get_rng_state(),
                    "epoch": done,
                },
                step=done,
            )
        if ctx.should_stop:
            return None

    metrics = evaluate(model, x_test, y_test)
    metrics.update({"epochs": epochs, "train_rows": int(len(y_train)), "heldout_rows": int(len(y_test)),
                    "train_s": round(time.perf_counter() - started, 4)})
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, ctx.output_dir / "model.pt")
    (ctx.output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    return metrics
