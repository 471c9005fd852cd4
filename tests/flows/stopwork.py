"""Work functions for the early-stop tests (imported by the child process
through ``run_job(..., code_dir=<this folder>)``).

``steps``: counts steps of ``step_s`` seconds, committing a checkpoint after
each ``every`` steps ``{"step": tensor, "w": tensor filled with the step}``; writes
``pid.txt`` (its pid) and ``resumed_from.txt`` at start, ``stopped_at.txt`` when it obeys the
stop warning, ``done.txt`` at the end.  Params: ``n`` (steps, 1000), ``step_s`` (0.2), ``every`` (1), ``state_mib`` (size of the state's tensor, MiB; 0 = 1 KiB), ``save_on_stop``
(checkpoint the current step when warned, True), ``ignore_stop`` (False),
``block_after`` (after that many steps, ``time.sleep(3600)``),
``blobs`` (files ``blob-<i>.bin`` of 1 MiB written at start: a return that takes a while),
``crash_after`` with ``crash`` = ``exit`` | ``segfault`` | ``sigkill`` |
``raise`` (crash once that step's checkpoint is committed; ``sigkill`` only
when not resumed, to stand in for a lost process).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import torch


def _state(step: int, mib: float = 0.0) -> dict:
    size = max(256, int(mib * 1024 * 1024 / 4))
    return {"step": torch.tensor(step), "w": torch.full((size,), float(step))}


def _crash(kind: str) -> None:
    if kind == "exit":
        os._exit(1)
    if kind == "segfault":
        ctypes.string_at(0)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("work raised on purpose")


def steps(ctx) -> None:
    p = {"n": 1000, "step_s": 0.2, "every": 1, "state_mib": 0.0, "save_on_stop": True, "ignore_stop": False, "block_after": None,
         "crash_after": None, "crash": "exit"}
    p.update(ctx.params)
    (ctx.output_dir / "pid.txt").write_text(str(os.getpid()))
    for i in range(int(p.get("blobs", 0))):
        (ctx.output_dir / f"blob-{i}.bin").write_bytes(os.urandom(1024 * 1024))
    restored = ctx.restore()
    start = restored[1] if restored else 0
    (ctx.output_dir / "resumed_from.txt").write_text(str(start))
    for step in range(start + 1, int(p["n"]) + 1):
        time.sleep(float(p["step_s"]))
        saved = step % int(p["every"]) == 0
        if saved:
            ctx.checkpoint(_state(step, p["state_mib"]), step, wait=True)
        ctx.progress(step, int(p["n"]))
        if p["crash_after"] is not None and step == int(p["crash_after"]):
            if p["crash"] != "sigkill" or restored is None:
                _crash(p["crash"])
        if p["block_after"] is not None and step >= int(p["block_after"]):
            time.sleep(3600)
        if not p["ignore_stop"] and ctx.should_stop:
            (ctx.output_dir / "stopped_at.txt").write_text(str(step))
            if p["save_on_stop"] and not saved:
                ctx.checkpoint(_state(step, p["state_mib"]), step, wait=True)
            return
    (ctx.output_dir / "done.txt").write_text("done")


def cancel_own_run_at_end(ctx) -> None:
    """Writes ``done.txt``, then asks the Prefect API to cancel the flow run
    named ``params["run_name"]`` (its own) and ends at once: a cancel that
    lands as the output starts its way back.  Params: ``files`` (extra
    files of that many KiB each, to make the return take a while, 0)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, FlowRunFilterState, \
        FlowRunFilterStateType
    from prefect.states import Cancelling

    for i in range(int(ctx.params.get("files", 0))):
        (ctx.output_dir / f"blob-{i}.bin").write_bytes(os.urandom(1024 * int(ctx.params.get("kib", 64))))
    (ctx.output_dir / "done.txt").write_text("done")
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=[ctx.params["run_name"]]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["RUNNING"]))))
        for run in runs:
            client.set_flow_run_state(run.id, Cancelling(), force=True)
    os._exit(0)  # at once: the supervisor sees the work end before its next read of the run's state

