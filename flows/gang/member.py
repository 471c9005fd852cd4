"""A gang's member: ``python -m e31.flows.gang.member FLOW_RUN_ID`` on one of its other nodes.

Started by that node's ``e31 worker`` (:mod:`e31.deployments.members`, ``E31_NODE`` set) for a run placed
with this node in its gang.  In order:

1. read the run, its spec and this node's rank (:meth:`PlacementRecord.rank_of`); a node not in its gang
   exits 2 with the reason;
2. stage every input on this node's scratch, ``<E31_SCRATCH>/<job>/member/`` (``data/``, ``output/``,
   ``checkpoints/``, ``run/``), reusing what an earlier attempt staged and left unchanged;
3. wait for the rendezvous of the run's current attempt (:mod:`e31.flows.gang.rendezvous`), and fetch the
   durable checkpoint the lead resumes from (waiting up to :data:`CHECKPOINT_WAIT_S` for it to land), so
   ``ctx.restore()`` gives every rank the same step;
4. run the work as rank ``RANK`` (a Python entrypoint or a command, as on the lead), uploading this rank's
   part of each sharded checkpoint it saves (:mod:`e31.tasks.work.sharded`; the lead writes the marker once
   every part is there, and the member publishes its last part before it says its work ended), and stop it with
   SIGTERM, then SIGKILL ``grace`` later: when the lead says its own work was warned (within
   :data:`WATCH_S`), when the run leaves ``Running`` (the lead returned, the run was cancelled or
   preempted, its node was lost) or another attempt publishes its rendezvous, and at the latest
   :data:`STOP_LATE_S` after the published warning time, or when the lead's work begins again (a failed
   work tried again publishes a new rendezvous; this node's worker starts a member for it);
5. write its work's exit status on the run (:func:`~e31.flows.gang.rendezvous.report_member`) and exit
   with it.

What it says goes to its standard output (the worker keeps it in ``member/run/member.log``) and to the
flow run's log, where the API answers; its work's output (``member/run/stdout.log`` and ``stderr.log``) goes
to the flow run's log too, each line as ``rank N: ...``.  Exit statuses: the work's own; 2 for a run this node is not a
member of, a spec that is not valid or an input that cannot be staged; 3 when the run ended before this
member's work started.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from e31.flows.gang.rendezvous import Published, published, report_member, stop_of

__all__ = ["CHECKPOINT_WAIT_S", "SERVING", "main"]

#: Seconds a member waits for the checkpoint the lead resumes from to be at the checkpoint URL.
CHECKPOINT_WAIT_S = 120.0
#: Seconds between reads of the run's state while the work runs (a stop reaches the member within it).
WATCH_S = 1.0
#: Seconds after the lead's own warning time a member warns its work by itself when the lead has not told it
#: (the lead tells its members as it warns its work: no rank is warned before rank 0, whose output counts).
STOP_LATE_S = 3.0
#: Seconds a member waits for the lead to publish the rendezvous of the run's attempt.
RENDEZVOUS_WAIT_S = 1800.0

EXIT_NOT_MEMBER, EXIT_RUN_ENDED = 2, 3
#: The file in the member's ``run/`` folder naming the try (its token) it serves, written as it meets the
#: rendezvous: what its worker writes an end for when the member dies without writing it.
SERVING = "serving"
#: Set by SIGTERM or SIGINT (the worker stopping): the work is warned, as at its stop time.
_TOLD: list[int] = []


class _Say:
    """A member's lines: printed, and sent to the flow run's log (best effort)."""

    def __init__(self, client: Any, run_id: str, rank: int | None = None) -> None:
        self.client, self.run_id, self.rank = client, run_id, rank

    def __call__(self, line: str, level: int = 20) -> None:
        from datetime import datetime, timezone

        from e31.tasks.storage import scrub

        text = scrub(f"member{'' if self.rank is None else f' rank {self.rank}'}: {line}")
        print(text, flush=True)
        try:
            from prefect.client.schemas.actions import LogCreate

            self.client.create_logs([LogCreate(name="e31.member", level=level, message=text,
                                               timestamp=datetime.now(timezone.utc), flow_run_id=self.run_id)])
        except Exception:  # the log on the run is a courtesy; the member's own log has the line
            pass


class _WorkLines:
    """The member's work output (``stdout.log``/``stderr.log`` in ``run_dir``), forwarded to the flow run's
    log as ``rank N: line`` (``rank N [stderr]: line``), rate-limited and masked as the lead's
    (:class:`e31.tasks.supervisor.output.OutputForwarder`), one request per :data:`WATCH_S` at most."""

    def __init__(self, client: Any, run_id: str, rank: int, run_dir: Path) -> None:
        from e31.tasks.storage import scrub
        from e31.tasks.supervisor.output import OutputForwarder

        self.client, self.run_id, self.rank = client, run_id, rank
        self.pending: list[Any] = []
        self.forwarder = OutputForwarder(run_dir, emit=self._take, mask=scrub)
        self.next = 0.0

    def _take(self, stream: str, line: str) -> None:
        from datetime import datetime, timezone

        from prefect.client.schemas.actions import LogCreate

        where = f"rank {self.rank}" + (" [stderr]" if stream == "stderr" else "")
        self.pending.append(LogCreate(name="e31.member", level=20, message=f"{where}: {line}",
                                      timestamp=datetime.now(timezone.utc), flow_run_id=self.run_id))

    def poll(self, final: bool = False) -> None:
        """Forward what is new (all of it with ``final``, once the work has ended); never raises."""
        if not final and time.monotonic() < self.next:
            return
        self.next = time.monotonic() + WATCH_S
        if final:
            self.forwarder.finish()
        else:
            self.forwarder.poll()
        batch, self.pending = self.pending, []
        if batch:
            try:
                self.client.create_logs(batch)
            except Exception:  # the log on the run is a courtesy: the lines stay in the member's run/ folder
                pass


def _read(client: Any, run_id: str) -> Any | None:
    try:
        return client.read_flow_run(run_id)
    except Exception:  # the API is away for a moment: the member goes on as it was
        return None


def _state(run: Any) -> str:
    return run.state.type.value if run is not None and run.state is not None else "UNKNOWN"


def _stage(spec: Any, data_dir: Path, say: _Say) -> dict[str, str]:
    """Stage every input of ``spec`` under ``data_dir``; input name -> local path."""
    from e31.tasks.stage import preflight, stage_input

    data_dir.mkdir(parents=True, exist_ok=True)
    listings = preflight(list(spec.data), data_dir)
    staged = {}
    for item in spec.data:
        done = stage_input(item, data_dir, listings[item.name])
        staged[item.name] = done.path
        say(f"input {item.name}: {'copied' if done.copied else 'already staged'} ({done.bytes} bytes, "
            f"{done.seconds:.1f} s)")
    return staged


def _wait_rendezvous(client: Any, run_id: str, node: str, rank: int, say: _Say,
                     after: str | None = None) -> Published | None:
    """The rendezvous of the run's current attempt, once the run is ``Running`` and its lead has published
    it (a try other than ``after``, one this node's member already served); None when the run ends first,
    is no longer placed with ``node`` as member ``rank`` (queued again, placed elsewhere), or
    :data:`RENDEZVOUS_WAIT_S` passes."""
    from e31.tasks.placement_record import record_of

    deadline = time.monotonic() + RENDEZVOUS_WAIT_S
    while time.monotonic() < deadline and not _TOLD:
        run = _read(client, run_id)
        state = _state(run)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "CANCELLING", "CRASHED"):
            say(f"the run is {run.state.name} before this member's work started: nothing to do")
            return None
        if run is not None and record_of(run).rank_of(node) != rank:
            say(f"the run is no longer placed with node {node} as rank {rank}: nothing to do")
            return None
        pub = published(run) if run is not None else None
        if state == "RUNNING" and pub is not None and pub.attempt == run.run_count and pub.token != after:
            return pub
        time.sleep(0.25)
    say("no rendezvous from the lead within the wait: stopping", 40)
    return None


def _fetch_checkpoint(plan: Any, step: int, checkpoint_dir: Path, say: _Say) -> None:
    """Make the lead's checkpoint of ``step`` this member's newest (fetched from the checkpoint URL, or
    already here).  Raises ``RuntimeError`` when it is not there within :data:`CHECKPOINT_WAIT_S`."""
    from e31.tasks import storage
    from e31.tasks.work.local_checkpoints import latest_valid, step_dir_name

    have = latest_valid(checkpoint_dir)
    if have is not None and have.step == step:
        return
    shutil.rmtree(checkpoint_dir, ignore_errors=True)
    checkpoint_dir.mkdir(parents=True)
    source, target = storage.join(plan.checkpoint_url, step_dir_name(step)), checkpoint_dir / step_dir_name(step)
    deadline = time.monotonic() + CHECKPOINT_WAIT_S
    while True:
        try:
            storage.get(source, target)
            got = latest_valid(checkpoint_dir)
            if got is not None and got.step == step:
                say(f"resumes from the lead's checkpoint of step {step}")
                return
        except FileNotFoundError:
            pass
        shutil.rmtree(target, ignore_errors=True)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the lead resumes from step {step}, whose checkpoint is not at "
                               f"{storage.scrub(plan.checkpoint_url)} within {CHECKPOINT_WAIT_S:g} s")
        time.sleep(1.0)


def _child_config(spec: Any, plan: Any, root: Path, staged: dict[str, str], code_dir: str | None, rank: int,
                  pub: Published) -> Any:
    from prefect.settings import PREFECT_API_URL

    from e31.flows.workconfig import placed_devices
    from e31.tasks.work.context import ChildConfig
    from e31.tasks.work.rendezvous import interface_of, own_address

    return ChildConfig(
        entrypoint=spec.work.entrypoint, command=spec.work.command, params=dict(spec.work.params), data=staged,
        output_dir=str(root / "output"), checkpoint_dir=str(root / "checkpoints"),
        progress_file=str(root / "run" / "progress.json"), device=plan.device, cpus=plan.cpus, gpus=plan.gpus,
        devices=placed_devices(plan.gpus), code_dirs=[code_dir] if code_dir else [],
        checkpoint_every_s=plan.checkpoint_every_s, checkpoint_every_steps=plan.checkpoint_every_steps,
        supervised=False, master_addr=pub.addr, master_port=pub.port, node_rank=rank, nnodes=plan.nodes,
        interface=interface_of(own_address(PREFECT_API_URL.value())), try_token=pub.token)


def _supervise(client: Any, run_id: str, proc: Any, pub: Published, say: _Say, parts: Any,
               lines: _WorkLines) -> int:
    """Watch the work's process until it ends, uploading its sharded checkpoints' parts (``parts``, an
    :class:`~e31.tasks.supervisor.uploader.Uploader`) and forwarding its output (``lines``); warn it (SIGTERM) and kill it (SIGKILL, ``grace``
    later) when the run stops.  Returns its exit status (negative: the signal that ended it)."""
    warned_at: float | None = None
    why = ""
    next_read = 0.0
    while proc.poll() is None:
        parts.poll()
        lines.poll()
        now = time.time()
        if warned_at is None:
            if _TOLD:
                why = "this node's worker is stopping"
            elif now >= pub.stop_at - pub.grace_s + STOP_LATE_S:
                why = "its stop time is near"
            elif now >= next_read:
                next_read = now + WATCH_S
                run = _read(client, run_id)
                state, latest = _state(run), published(run) if run is not None else None
                told = stop_of(run, pub.token) if run is not None else None
                if told is not None:
                    why = f"the lead's work was warned ({told})"
                elif run is not None and state != "RUNNING":
                    why = f"the run is {run.state.name}"
                elif latest is not None and latest.token != pub.token:
                    why = "the lead's work has begun again"
            if why:
                say(f"stopping the work: {why}")
                _signal(proc, signal.SIGTERM)
                warned_at = now
        elif now >= min(warned_at + pub.grace_s, max(pub.stop_at, warned_at)):
            say(f"the work did not end within {pub.grace_s:g} s of its warning: killed", 30)
            _signal(proc, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.1)
    return proc.returncode


def _signal(proc: Any, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the work's whole process group (it was started in a session of its own)
    except ProcessLookupError:
        pass


def run_member(run_id: str, node: str, after: str | None = None) -> int:
    """Take the steps of the module docstring for the flow run ``run_id`` on ``node`` (``after``: the try
    of the lead's work a member here already served, skipped); returns the exit status."""
    from prefect.client.orchestration import get_client

    from e31.flows.compile import compile_plan
    from e31.flows.queue.mapping import stored_spec
    from e31.tasks.placement_record import record_of
    from e31.tasks.stage import StageError
    from e31.tasks.storage.options import register_destination, register_inputs
    from e31.tasks.supervisor.uploader import Uploader
    from e31.tasks.supervisor.warm import child_environment, spawn

    with get_client(sync_client=True) as client:
        say = _Say(client, run_id)
        run = client.read_flow_run(run_id)
        record = record_of(run)
        rank = record.rank_of(node)
        if not rank:
            say(f"node {node} is not a member of this run's gang ({', '.join(record.nodes) or 'not placed'})", 40)
            return EXIT_NOT_MEMBER
        say.rank = rank
        try:
            spec = stored_spec(run)
            plan = compile_plan(spec)
            register_inputs(spec)
            register_destination(spec, plan)
            root = Path(plan.scratch) / "member"
            (root / "run").mkdir(parents=True, exist_ok=True)
            staged = _stage(spec, root / "data", say)
        except (StageError, ValueError, OSError) as exc:
            say(f"cannot start: {exc}", 40)
            return EXIT_NOT_MEMBER
        pub = _wait_rendezvous(client, run_id, node, rank, say, after)
        if pub is None or _TOLD:
            return EXIT_RUN_ENDED
        (root / "run" / SERVING).write_text(pub.token)  # the try this member serves, for its worker
        try:
            if pub.resume is not None:
                _fetch_checkpoint(plan, pub.resume, root / "checkpoints", say)
            else:
                shutil.rmtree(root / "checkpoints", ignore_errors=True)  # a fresh start: no earlier state
            output = root / "output"
            shutil.rmtree(output, ignore_errors=True)
            output.mkdir(parents=True)
        except (RuntimeError, OSError) as exc:
            say(f"cannot start: {exc}", 40)
            report_member(client, run_id, rank, pub, EXIT_NOT_MEMBER)
            return EXIT_NOT_MEMBER
        cfg = _child_config(spec, plan, root, staged, (run.parameters or {}).get("code_dir"), rank, pub)
        config_path = root / "run" / "child.json"
        cfg.write(config_path)
        command = list(cfg.command or [sys.executable, "-m", "e31.tasks.work.child", str(config_path)])
        cwd = cfg.code_dirs[0] if cfg.command and cfg.code_dirs else cfg.output_dir
        proc = spawn(command, cwd, child_environment(cfg, uuid.uuid4().hex), root / "run")
        say(f"work started as rank {rank} of {plan.nodes}, meeting at {pub.addr}:{pub.port} (attempt {pub.attempt})")
        parts = Uploader(root / "checkpoints", plan.checkpoint_url, plan.checkpoint_keep, api_alive=lambda: False,
                         seals=False)
        lines = _WorkLines(client, run_id, rank, root / "run")
        code = _supervise(client, run_id, proc, pub, say, parts, lines)
        lines.poll(final=True)
        say(f"work ended with exit status {code}", 20 if code == 0 else 40)
        parts.finish(inline=True)  # its last part is at the checkpoint URL before the lead hears of its end
        for problem in parts.failures:
            say(f"checkpoint: {problem}", 30)
        try:
            report_member(client, run_id, rank, pub, code)
        except Exception:  # the lead learns of a dead peer from its own collectives too
            pass
        return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    """``python -m e31.flows.gang.member FLOW_RUN_ID``: the member's run on ``E31_NODE``."""
    parser = argparse.ArgumentParser(prog="e31.flows.gang.member", description=__doc__.splitlines()[0])
    parser.add_argument("flow_run_id")
    parser.add_argument("--after", default=None, help="the token of a try of the lead's work already served")
    args = parser.parse_args(argv)
    node = os.environ.get("E31_NODE")
    for sig in (signal.SIGTERM, signal.SIGINT):  # the work is warned and given its grace, not left behind
        signal.signal(sig, lambda signum, frame: _TOLD.append(signum))
    if not node:
        print("member: E31_NODE is not set: a member runs on a node an e31 worker serves", file=sys.stderr)
        return EXIT_NOT_MEMBER
    return run_member(args.flow_run_id, node, args.after)


if __name__ == "__main__":
    sys.exit(main())
