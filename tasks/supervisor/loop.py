"""The supervisor loop of the run task, in the flow's process.

It owns the clock and the signals (docs/design.md §2, "Why a child
process"): it starts the child in its own process group, has each new
committed checkpoint made durable while the child keeps working, shows
progress and forwards the work's output, and stops the child at the stop
time -- SIGTERM (``ctx.should_stop``) ``grace`` seconds before the hard stop,
then SIGKILL.  A cancel of the flow run (polled from the Prefect API) or
SIGTERM/SIGINT to the flow's own process starts the same stop early.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from prefect.logging import get_run_logger

from e31.tasks.deliver import ReturnTarget
from e31.tasks.outcome import RunOutcome
from e31.tasks.pending import RETURNING_FIRST
from e31.tasks.returning import return_output
from e31.tasks.storage import scrub
from e31.tasks.storage.local import human_size, no_space
from e31.tasks.supervisor.output import OutputForwarder, tail_lines
from e31.tasks.supervisor.process import SIGNALLED, WorkTree, defer_signals_after_work, set_subreaper
from e31.tasks.supervisor.progress import ProgressReporter
from e31.tasks.supervisor.report import empty_output, read_time, say_resume, time_phases
from e31.tasks.checkpoint import fetch_sharded
from e31.tasks.supervisor.uploader import Uploader
from e31.tasks.supervisor.warm import child_environment, go, import_torch_here, kill, spawn, take
from e31.tasks.supervisor.watch import RunWatch  # noqa: F401 (named here by the run task's callers)
from e31.tasks.work.context import ChildConfig
from e31.tasks.work.local_checkpoints import latest_valid

POLL_S = 0.2  # seconds between supervisor checks
STOP_SEEN = "stop_seen"  # written beside the progress file when the work reads ctx.should_stop as true
RETURNED = "returned"
BEGUN = "begun"  # written beside the progress file by the child just before the work's function is called
MEMORY_EVERY_S = 0.5  # seconds between measurements of the work's resident memory  # written beside the progress file by the child once the work's function returned
CHILD_PGID = "child.pgid"  # process group of the running work
RESERVE_EVERY_S = 2.0  # seconds between re-estimates of the deadline's return reserve
#: The stop reasons of a cancel through the Prefect API: the user's (``cancelled``) or the queue's preemption.
CANCEL_REASONS = ("cancelled", "preempted")
TAIL_LINES = 20  # lines of the work's stdout and stderr kept in the outcome and the manifest


@dataclass
class SupervisorConfig:
    """What the run task needs (built by ``e31.flows.compile``).

    ``limit_at``: the hard stop from the time limit, Unix seconds.
    ``deadline_at``: the deadline, Unix seconds (None: none); the run stops
    at ``deadline_at`` minus the return reserve, ``max(reserve_floor_s,
    bytes to return / return_rate)`` re-estimated while it runs (bytes/s).
    ``grace_s``: seconds between the SIGTERM warning and SIGKILL.
    ``run_dir`` holds logs and the progress file (its parent is the job's
    scratch folder).  ``output_options`` (unresolved references) and
    ``checkpoints`` go into the pending record of a return the run task
    makes itself (after a cancel).  ``memory``: ``request.memory`` in bytes,
    enforced on the work's whole process tree (None: not limited).
    ``watch``: makes the :class:`RunWatch` of the flow run (called with
    ``flow_run_id`` once per try of the run task).  ``rendezvous``: for a
    gang's lead, called once per try of the run task with ``child`` and the
    step the try resumes from (None: a fresh start) just before the work
    starts; returns ``child`` with the try's rendezvous, which it has
    published to the members (:func:`e31.flows.gang.lead.lead_child`).
    """

    job: str
    child: ChildConfig
    run_dir: str
    checkpoint_url: str
    keep: int
    grace_s: float
    limit_at: float
    target: ReturnTarget
    deadline_at: float | None = None
    reserve_floor_s: float = 30.0
    return_rate: float = 50 * 1024**2
    flow_run_id: str | None = None
    work_sha256: str | None = None
    output_options: dict = field(default_factory=dict)
    checkpoints: dict | None = None
    memory: int | None = None
    watch: Callable[[str | None], RunWatch] | None = None
    rendezvous: Callable[[ChildConfig, int | None], ChildConfig] | None = None


class _Stop:
    """The first stop request wins; later ones are ignored."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.warned_at: float | None = None
        self.hard_at: float | None = None

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason


class _Clock:
    """The stop time: the time limit, or the deadline less the return reserve."""

    def __init__(self, settings: SupervisorConfig):
        self.s = settings
        self._next = 0.0
        self.stop_at, self.reason = settings.limit_at, "time_limit"

    def update(self, now: float) -> None:
        if self.s.deadline_at is None or now < self._next:
            return
        self._next = now + RESERVE_EVERY_S
        pending = _folder_bytes(Path(self.s.child.output_dir)) + _folder_bytes(Path(self.s.child.checkpoint_dir))
        by_deadline = self.s.deadline_at - max(self.s.reserve_floor_s, pending / self.s.return_rate)
        self.stop_at, self.reason = (
            (by_deadline, "deadline") if by_deadline < self.s.limit_at else (self.s.limit_at, "time_limit")
        )


def _folder_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def supervise(settings: SupervisorConfig) -> RunOutcome:
    """The supervisor loop behind :func:`run_task`."""
    run_dir = Path(settings.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    empty_output(Path(settings.child.output_dir))  # nothing but the checkpoint carries over into a run's work
    config_path = run_dir / "child.json"
    settings.child.write(config_path)
    stdout_path, stderr_path = run_dir / "stdout.log", run_dir / "stderr.log"
    Path(settings.child.progress_file).unlink(missing_ok=True)  # no stale progress from an earlier run
    stop_seen = Path(settings.child.progress_file).with_name(STOP_SEEN)
    stop_seen.unlink(missing_ok=True)
    returned = Path(settings.child.progress_file).with_name(RETURNED)
    returned.unlink(missing_ok=True)
    begun = Path(settings.child.progress_file).with_name(BEGUN)
    begun.unlink(missing_ok=True)
    warm = take(settings.run_dir)  # a child started while the inputs staged, waiting for its go
    try:
        if not settings.child.command:
            import_torch_here()  # (to convert the work's handed-over checkpoints)
        token = warm.token if warm is not None else uuid.uuid4().hex  # marks every process of this run
        if settings.rendezvous is not None:  # a gang: each try of the work meets its peers anew
            rejected: list[str] = []
            try:  # the newest whole sharded checkpoint is at the checkpoint URL, not here
                fetch_sharded(Path(settings.child.checkpoint_dir), settings.checkpoint_url, settings.work_sha256,
                              rejected)
                for line in rejected:
                    get_run_logger().warning("e31: %s", line)
            except Exception as exc:
                get_run_logger().warning("e31: the newest sharded checkpoint could not be fetched (%s); the work "
                                         "resumes from the newest whole one here", scrub(str(exc)))
            latest = latest_valid(Path(settings.child.checkpoint_dir))
            settings.child = settings.rendezvous(settings.child, latest.step if latest is not None else None)
            settings.child.write(config_path)
        env = child_environment(settings.child, token)
        tree = WorkTree(token)
        command = list(settings.child.command or [sys.executable, "-m", "e31.tasks.work.child", str(config_path)])

        stop, clock = _Stop(), _Clock(settings)
        cancel = settings.watch(settings.flow_run_id)
        uploader = Uploader(Path(settings.child.checkpoint_dir), settings.checkpoint_url, settings.keep,
                            settings.work_sha256, settings.flow_run_id, api_alive=cancel.api_alive,
                            on_durable=getattr(cancel, "checkpoint_durable", None))
        progress = ProgressReporter(settings.job, Path(settings.child.progress_file))
        output = OutputForwarder(run_dir, emit=_run_log, mask=scrub)
    except BaseException:
        if warm is not None:
            kill(warm)
        raise
    restore = _install_signal_handlers(stop)
    started = time.time()
    # A command runs in the spec's folder (so `python train.py` finds its script); a Python
    # entrypoint in its output folder.  Either way outputs go to E31_OUTPUT_DIR.
    cwd = settings.child.code_dirs[0] if settings.child.command and settings.child.code_dirs else settings.child.output_dir
    resumed_from = say_resume(env.get("E31_RESUME_DIR", ""), settings.checkpoint_url)
    if warm is not None:
        set_subreaper()  # orphans of the work are re-parented here, not to init
        proc = warm.proc
        go(warm, env)
    else:
        try:
            proc = spawn(command, cwd, env, run_dir)
        except OSError as exc:  # a command that does not exist or cannot be executed
            restore()
            cancel.stop()
            return RunOutcome(reason="error", exit_code=127, run_s=0.0,
                              message=f"cannot start work.command {command!r}: {exc.strerror}",
                              checkpoint=uploader.finish(), resumed_from_step=resumed_from)
    exec_at = time.time()  # a command's work starts here (Popen returns once it is exec'd)
    (run_dir / CHILD_PGID).write_text(str(proc.pid))  # lets the next attempt clean up after a kill -9
    killed = False
    memory_at = 0.0
    ended = False  # the loop saw the child's end (not a teardown of the supervisor)
    peer_failed = getattr(cancel, "peer_failed", None)
    peer: tuple[bool, str] | None = None  # a gang's peer that failed while this rank's work ran: (lost, why)
    try:
        while proc.poll() is None:
            now = time.time()
            if now >= memory_at:  # the whole tree's resident memory against request.memory
                memory_at = now + MEMORY_EVERY_S
                if tree.rss() > (settings.memory or float("inf")) and stop.reason != "out_of_memory":
                    stop.reason, stop.warned_at = "out_of_memory", stop.warned_at or now
                    tree.kill(spare=proc.pid)
                    killed = True
                    proc.wait()
                    break
            if stop.reason is None and peer_failed is not None and (peer := peer_failed()) is not None:
                # a gang's rank whose peer is gone would wait in its next collective until its own timeout
                _signal_group(proc, signal.SIGKILL)
                killed = True
                proc.wait()
                break
            clock.update(now)
            if now >= clock.stop_at - settings.grace_s:
                stop.request(clock.reason)
            moved = cancel.moved_to()
            if moved is not None:  # fenced: the run is another node's now; no checkpoint or output from here
                _signal_group(proc, signal.SIGKILL)
                tree.kill()
                cancel.step_aside(moved)
            if cancel.cancelled():
                stop.request(_cancel_reason(cancel))
            if stop.reason and stop.warned_at is None:
                if stop.reason == "signal" and cancel.refresh():
                    stop.reason = _cancel_reason(cancel)  # a worker's SIGTERM after a cancel or a preemption
                stop.warned_at = now
                stop.hard_at = min(clock.stop_at, now + settings.grace_s) if stop.reason in ("time_limit", "deadline") else now + settings.grace_s
                _signal_group(proc, signal.SIGTERM)
                if (warned := getattr(cancel, "warned", None)) is not None:
                    warned(stop.reason)
            if stop.hard_at is not None and now >= stop.hard_at:
                _signal_group(proc, signal.SIGKILL)
                killed = True
                proc.wait()
                break
            uploader.poll()
            progress.poll()
            output.poll()
            try:
                proc.wait(timeout=POLL_S)  # wakes as soon as the child exits
            except subprocess.TimeoutExpired:
                pass
        ended = True
    finally:
        if proc.poll() is None:  # the supervisor itself is being torn down
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        restore()
        if ended:  # from the work's end on, its output is returned: a signal (a worker's, after a late cancel) waits
            defer_signals_after_work(RETURNING_FIRST)
        cancel.stop()
    if ended and stop.warned_at is None:  # asked for as the work ended, never acted on: the work ended by itself
        stop.reason = None
    if ended and cancel.moved_to() is None and _ended_by_itself(stop, proc.returncode, settings, stop_seen):
        cancel.work_ended()  # a cancel from now on changes nothing (e31 cancel: too late)
    run_s = time.time() - started
    _signal_group(proc, signal.SIGKILL)  # leftovers of the child's process group ...
    tree.kill(spare=proc.pid)  # ... and every process the work started, in any session
    progress.poll(final=True)
    output.finish()
    cancelled = stop.reason in CANCEL_REASONS
    exited = time.time()
    latest = uploader.finish(inline=cancelled)
    phases = time_phases(started, begun, returned, exited)
    if warm is not None:  # how long the child had been loading before its go (overlapping staging)
        phases["prestart_s"] = max(0.0, started - warm.spawned_at)
    for note in uploader.notes:
        get_run_logger().warning("%s", note)
    code = proc.returncode
    if killed and returned.exists() and stop.reason != "out_of_memory":  # only the teardown was cut
        code, killed = 0, False
    if stop.reason and code == 0 and not settings.child.command and not stop_seen.exists():
        stop.reason = None  # the work finished during the grace period without ever seeing the warning
    outcome = _outcome(code, stop, killed, run_s, tail_lines(stderr_path, TAIL_LINES, scrub))
    if peer is not None:  # stopped because a peer failed: the try is lost (retried) when the peer was killed
        outcome.reason, outcome.message = "crashed" if peer[0] else "error", f"{peer[1]}; this rank's work was stopped"
    elif outcome.reason == "error" and (peer_lost := getattr(cancel, "peer_lost", None)) is not None:
        lost = peer_lost()  # a gang's rank whose peer died fails in its next collective: the try is lost
        if lost:
            outcome.reason, outcome.message = "crashed", f"{lost}; this rank's work then exited with code {code}"
    outcome.peak_memory = tree.peak_rss
    outcome.phases = phases
    outcome.work_started_at = exec_at if settings.child.command else read_time(begun)
    outcome.resumed_from_step = resumed_from
    outcome.checkpoint_at = uploader.durable_at
    if stop.reason == "out_of_memory":
        outcome.message = (f"the work used {human_size(tree.peak_rss)} of resident memory, over request.memory "
                           f"{human_size(settings.memory or 0)}; killed. Ask for more memory, or use less")
    outcome.stdout_tail = tail_lines(stdout_path, TAIL_LINES, scrub)
    outcome.output_lines_dropped = output.dropped
    outcome.stop_requested_at = stop.warned_at
    outcome.checkpoint, outcome.uploads = latest, uploader.done
    if outcome.reason in ("error", "crashed"):  # the work's own writes may have filled the scratch disk
        full = no_space(Path(settings.child.output_dir), "No space left on device" in outcome.stderr_tail)
        if full:
            outcome.message = f"{outcome.message}; {full}"
    if uploader.failures:
        last = uploader.failures[-1]
        outcome.message = "; ".join(filter(None, [
            outcome.message, last if last.startswith("checkpoint ") else "checkpoint upload failed: " + last]))
    moved = cancel.moved_to()
    if moved is not None:  # fenced as the work ended: the output is the other node's attempt's to return
        cancel.step_aside(moved)
    if cancelled:  # delivered now, in this task: a worker may end the process soon after a cancel
        outcome.manifest = return_output(run_dir.parent, settings.target, outcome,
                                         output_options=settings.output_options, checkpoints=settings.checkpoints)
    return outcome


def _run_log(stream: str, line: str) -> None:
    """One line of the work's output into the run task's log (the flow run's
    log in the UI, the terminal under ``e31 run``)."""
    logger = get_run_logger()
    if stream == "stdout":
        logger.info("%s", line)
    elif stream == "stderr":
        logger.info("[stderr] %s", line)
    else:
        logger.warning("%s", line)


def _outcome(code: int, stop: _Stop, killed: bool, run_s: float, tail: str) -> RunOutcome:
    if stop.reason == "out_of_memory":
        reason, message = "out_of_memory", "killed for memory"
    elif stop.reason:
        reason = stop.reason
        message = f"stopped early ({reason})" + ("; killed after the grace period" if killed else "")
    elif code == 0:
        reason, message = "finished", ""
    elif code == -signal.SIGKILL:
        reason, message = "crashed", "work process killed by SIGKILL (out of memory, or killed outside E31)"
    else:
        reason, message = "error", f"work exited with code {code}"
    return RunOutcome(reason=reason, exit_code=code, run_s=run_s, killed=killed, message=message, stderr_tail=tail)


def _ended_by_itself(stop: _Stop, code: int | None, settings: SupervisorConfig, stop_seen: Path) -> bool:
    """Whether the work ended without a cancel stopping it: no cancel was
    requested, or a Python work finished within the grace period without
    ever reading ``ctx.should_stop`` as true (counted as finished below)."""
    if stop.reason not in CANCEL_REASONS:
        return True
    return code == 0 and not settings.child.command and not stop_seen.exists()


def _cancel_reason(cancel: RunWatch) -> str:
    """``preempted`` when the cancel seen is the queue's preemption of the run, else ``cancelled``."""
    preempted = getattr(cancel, "preempted", None)
    return "preempted" if preempted is not None and preempted() else "cancelled"


def _install_signal_handlers(stop: _Stop):
    """SIGTERM/SIGINT to the flow process (preemption, Ctrl-C) request a
    stop with reason ``signal``.  Only possible from the main thread; returns
    a function restoring the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.getsignal(sig)
        signal.signal(sig, lambda signum, frame: (SIGNALLED.set(), stop.request("signal")))

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
