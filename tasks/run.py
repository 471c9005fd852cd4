"""The ``run`` task: run the work in a supervised child process.

The supervisor owns the clock and the signals (DESIGN.md §2, "Why a child
process"): it starts the child in its own process group, uploads each new
committed checkpoint through the ``checkpoint`` task while the child keeps
working, shows progress, and stops the child at the stop time -- SIGTERM
(``ctx.should_stop``) ``grace`` seconds before the hard stop, then SIGKILL.
A cancel of the flow run (polled from the Prefect API) or SIGTERM/SIGINT to
the flow's own process starts the same stop early.  The task returns a
:class:`RunOutcome` instead of raising, so the return step always runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from prefect import task

from tasks.checkpoint import DurableCheckpoint, checkpoint_task, latest_durable
from tasks.checkpoints import committed
from tasks.context import ChildConfig, command_environment
from tasks.progress import ProgressReporter
from tasks.cancel import CancelWatcher

POLL_S = 0.2  # seconds between supervisor checks
STDERR_TAIL_LINES = 20


@dataclass
class RunSettings:
    """What the run task needs (built by ``flows.compile``).

    ``stop_at`` is the hard stop as a Unix time in seconds (None: no stop
    time), ``stop_reason`` the reason recorded when it is reached
    (``time_limit`` or ``deadline``), ``grace_s`` the seconds between the
    SIGTERM warning and SIGKILL.  ``run_dir`` holds logs and the progress
    file; ``checkpoint_url`` is the durable checkpoint root.
    """

    job: str
    child: ChildConfig
    run_dir: str
    checkpoint_url: str
    keep: int
    grace_s: float
    stop_at: float | None = None
    stop_reason: str = "time_limit"
    flow_run_id: str | None = None


@dataclass
class RunOutcome:
    """How the run ended.

    ``reason``: ``finished`` | ``time_limit`` | ``deadline`` | ``cancelled`` |
    ``signal`` | ``error``.  ``exit_code`` is the child's (negative: killed
    by that signal).  ``checkpoint`` is the newest durable checkpoint.
    ``run_s`` is the wall time in seconds from child start to exit.
    """

    reason: str
    exit_code: int | None
    run_s: float
    checkpoint: DurableCheckpoint | None = None
    killed: bool = False
    message: str = ""
    stderr_tail: str = ""
    uploads: list[DurableCheckpoint] = field(default_factory=list)


class _Stop:
    """The first stop request wins; later ones are ignored."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.warned_at: float | None = None

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason


def _child_command(settings: RunSettings, config_path: Path) -> list[str]:
    if settings.child.command:
        return list(settings.child.command)
    return [sys.executable, "-m", "tasks.child", str(config_path)]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


class _Uploader:
    """Uploads the newest committed local checkpoint, one at a time, through
    the ``checkpoint`` task; intermediate ones are skipped when the store is
    slower than the work."""

    def __init__(self, settings: RunSettings):
        self.settings = settings
        self.root = Path(settings.child.checkpoint_dir)
        self.done: list[DurableCheckpoint] = []
        self.failures: list[str] = []
        self._future = None
        self._submitted: set[int] = set()

    def poll(self) -> None:
        if self._future is not None:
            if not self._future.state.is_final():
                return
            self._collect()
        newest = committed(self.root)
        if newest and newest[-1].step not in self._submitted:
            ckpt = newest[-1]
            self._submitted.add(ckpt.step)
            self._future = checkpoint_task.with_options(task_run_name=f"checkpoint-step-{ckpt.step}").submit(
                ckpt.path, self.settings.checkpoint_url, self.settings.keep
            )

    def _collect(self) -> None:
        try:
            self.done.append(self._future.result())
        except Exception as exc:  # upload failed after retries: keep going, report it
            self.failures.append(str(exc))
        self._future = None
        self._prune_local()

    def _prune_local(self) -> None:
        if not self.done:
            return
        uploaded = self.done[-1].step
        local = [c for c in committed(self.root) if c.step <= uploaded]
        for ckpt in local[: max(0, len(local) - self.settings.keep)]:
            shutil.rmtree(ckpt.path, ignore_errors=True)

    def finish(self) -> DurableCheckpoint | None:
        """Upload whatever is newest now and wait for it; return the newest
        durable checkpoint."""
        self.poll()
        if self._future is not None:
            self._future.wait()
            self._collect()
        self.poll()
        if self._future is not None:
            self._future.wait()
            self._collect()
        return self.done[-1] if self.done else latest_durable(self.settings.checkpoint_url)


@task(name="run", task_run_name="run")
def run_task(settings: RunSettings) -> RunOutcome:
    """Run the work to the end or to its stop; see the module docstring.
    Returns a :class:`RunOutcome`; never raises for the work's own failure."""
    return supervise(settings)


def supervise(settings: RunSettings) -> RunOutcome:
    """The supervisor loop behind :func:`run_task` (callable without Prefect
    for the parts that do not upload)."""
    run_dir = Path(settings.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "child.json"
    settings.child.write(config_path)
    stdout_path, stderr_path = run_dir / "stdout.log", run_dir / "stderr.log"
    Path(settings.child.progress_file).unlink(missing_ok=True)  # no stale progress from an earlier run
    env = {**os.environ, **command_environment(settings.child)}
    env["PYTHONPATH"] = os.pathsep.join([*settings.child.code_dirs, env.get("PYTHONPATH", "")]).strip(os.pathsep)

    stop = _Stop()
    uploader = _Uploader(settings)
    progress = ProgressReporter(settings.job, Path(settings.child.progress_file))
    cancel = CancelWatcher(settings.flow_run_id)
    restore = _install_signal_handlers(stop)
    started = time.time()
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            _child_command(settings, config_path),
            cwd=settings.child.output_dir,
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,  # its own process group: signals reach the whole tree
        )
    killed = False
    try:
        while proc.poll() is None:
            now = time.time()
            if settings.stop_at is not None and now >= settings.stop_at - settings.grace_s:
                stop.request(settings.stop_reason)
            if cancel.cancelled():
                stop.request("cancelled")
            if stop.reason and stop.warned_at is None:
                stop.warned_at = now
                _signal_group(proc, signal.SIGTERM)
            hard = settings.stop_at if stop.reason in ("time_limit", "deadline") else None
            if stop.warned_at is not None:
                hard = min(hard or float("inf"), stop.warned_at + settings.grace_s)
            if hard is not None and now >= hard:
                _signal_group(proc, signal.SIGKILL)
                killed = True
                proc.wait()
                break
            uploader.poll()
            progress.poll()
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:  # the supervisor itself is being torn down
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        restore()
    run_s = time.time() - started
    _signal_group(proc, signal.SIGKILL)  # leftovers of the child's process group
    progress.poll(final=True)
    latest = uploader.finish()
    code = proc.returncode
    tail = _tail(stderr_path)
    if stop.reason:
        reason, message = stop.reason, f"stopped early ({stop.reason})" + ("; killed after the grace period" if killed else "")
    elif code == 0:
        reason, message = "finished", ""
    else:
        reason, message = "error", f"work exited with code {code}"
    if uploader.failures:
        message = "; ".join(filter(None, [message, "checkpoint upload failed: " + uploader.failures[-1]]))
    return RunOutcome(
        reason=reason,
        exit_code=code,
        run_s=run_s,
        checkpoint=latest,
        killed=killed,
        message=message,
        stderr_tail=tail,
        uploads=uploader.done,
    )


def _install_signal_handlers(stop: _Stop):
    """SIGTERM/SIGINT to the flow process (preemption, Ctrl-C) request a
    stop with reason ``signal``.  Only possible from the main thread; returns
    a function restoring the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.getsignal(sig)
        signal.signal(sig, lambda signum, frame: stop.request("signal"))

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
