"""A training work for the exact-resume test: Adam, a step LR scheduler, a
grad scaler, dropout (so the RNG matters), shuffled mini-batches, and
checkpoints every ``every_steps`` optimizer steps in the middle of epochs.

Each optimizer step appends ``{"step", "epoch", "lr", "ids"}`` to
``steps.jsonl`` in the output (its lines so far are kept in each checkpoint
too: a resumed run's output folder starts empty, and it writes them back);
the final weights go to ``model.pt``.  With
``kill_after_step`` the process SIGKILLs itself right after committing that
step's checkpoint (first attempt only), standing in for a lost node.
"""

from __future__ import annotations

import json
import os
import signal

import torch
from torch import nn

from e31.examples.digits import load_digits_csv


def train(ctx) -> None:
    p = {"epochs": 3, "batch_size": 64, "every_steps": 7, "kill_after_step": None, "seed": 0}
    p.update(ctx.params)
    torch.manual_seed(int(p["seed"]))
    x, y = load_digits_csv(ctx.data["digits"])
    n, batch = len(y), int(p["batch_size"])
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Dropout(0.2), nn.Linear(48, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.8)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    log_path = ctx.output_dir / "steps.jsonl"
    step, epoch, pos, order = 0, 0, 0, None

    restored = ctx.restore()
    if restored is not None:
        state, step = restored
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        epoch, pos, order = state["epoch"], state["pos"], state["order"]
        ctx.set_rng_state(state["rng"])
        logged = state["log"]
    else:
        logged = ""
    log_path.write_text(logged)
    (ctx.output_dir / "resumed_from.txt").write_text(str(step))

    with open(log_path, "a") as log:
        while epoch < int(p["epochs"]):
            if order is None:
                order = torch.randperm(n)
            while pos < n:
                ids = order[pos : pos + batch]
                lr = scheduler.get_last_lr()[0]
                loss = nn.functional.cross_entropy(model(x[ids]), y[ids])
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                step, pos = step + 1, pos + len(ids)
                line = json.dumps({"step": step, "epoch": epoch, "lr": lr, "ids": ids.tolist()}) + "\n"
                log.write(line)
                log.flush()
                logged += line
                if step % int(p["every_steps"]) == 0:
                    state = {
                        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch, "pos": pos, "order": order, "rng": ctx.rng_state(), "log": logged,
                    }
                    ctx.checkpoint(state, step, wait=True)
                    if step == p["kill_after_step"] and restored is None:
                        os.kill(os.getpid(), signal.SIGKILL)
            epoch, pos, order = epoch + 1, 0, None
    torch.save(model.state_dict(), ctx.output_dir / "model.pt")
