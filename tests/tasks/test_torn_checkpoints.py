"""Killing the writer with SIGKILL at random moments of a checkpoint write,
50 times in a row, never yields a resume from a torn checkpoint."""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path

import torch

from e31.tasks.work.local_checkpoints import STATE_FILE, commit_pending, discard_torn, latest_valid, load_state, save_state, write_state

SIZE = 1 << 20  # floats per checkpoint (4 MiB): a write takes a few milliseconds


def _writer(root: str, first_step: int, started, supervised: bool) -> None:
    """Write checkpoints forever: committing them itself (``save_state``), or
    only writing them for a supervisor to commit (``write_state`` in the
    hand-over form the supervisor converts)."""
    step = first_step
    started.set()
    while True:
        state = {"step": step, "w": torch.full((SIZE,), float(step))}
        if supervised:  # as the work's process writes under a supervisor: the raw hand-over form
            write_state(Path(root), state, step, handoff=True)
        else:
            save_state(Path(root), state, step)
        step += 1


def test_fifty_random_kills_never_resume_from_a_torn_checkpoint(tmp_path):
    # forkserver: each writer is forked from a clean server that preloaded torch, so it is
    # started in milliseconds and does not inherit this process's threads (OpenMP, Prefect).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "e31.tasks.work.local_checkpoints"])
    rng = random.Random(31)
    torn_seen = 0
    resumed_steps = []
    for attempt in range(50):
        supervised = attempt % 2 == 1
        latest = latest_valid(tmp_path)
        start = latest.step + 1 if latest else 1
        started = ctx.Event()
        proc = ctx.Process(target=_writer, args=(str(tmp_path), start, started, supervised))
        proc.start()
        assert started.wait(timeout=60)
        time.sleep(rng.uniform(0.005, 0.12))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        # what a kill can leave: a step folder without its marker (half-written, or written
        # but not yet committed)
        torn_seen += sum(1 for p in tmp_path.iterdir() if not (p / "COMMITTED").exists())
        # what the supervisor and the next attempt do: commit what was written whole, drop the rest
        commit_pending(tmp_path, newest_only=True)
        discard_torn(tmp_path)
        assert all((p / "COMMITTED").exists() for p in tmp_path.iterdir())
        latest = latest_valid(tmp_path)
        if latest is not None:
            state = load_state(latest.path / STATE_FILE)
            assert state["step"] == latest.step
            assert torch.equal(state["w"], torch.full((SIZE,), float(latest.step)))
            resumed_steps.append(latest.step)
        for p in list(tmp_path.iterdir()):  # keep the folder small: drop all but the newest few
            if p.name.startswith("step-") and latest and int(p.name[5:]) < latest.step - 2:
                shutil.rmtree(p)
    print(f'torn leftovers seen: {torn_seen}, resumes: {len(resumed_steps)}')
    assert torn_seen > 0  # the kills did land in the middle of writes
    assert resumed_steps == sorted(resumed_steps) and len(resumed_steps) >= 40
