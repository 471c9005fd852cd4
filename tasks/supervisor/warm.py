"""A work's child process started ahead of its run: while the inputs stage.

Starting a Python child costs its interpreter and the entrypoint's own
imports (torch among them, when the work's module imports it: about
1-1.5 s on a 2-core machine).  None of that needs the staged inputs, so
:func:`prestart` spawns the child before staging, as
``python -m e31.tasks.work.child --warm CONFIG``: it imports the
entrypoint, then blocks on its stdin.  The run task's supervisor takes it
(:func:`take`), writes the final config, and sends one line, the JSON of the
environment variables that depend on staging and on the checkpoints
(``E31_DATA_*``, ``E31_RESUME_DIR``, ...); the child sets them and runs the
work.  Everything else about the child is as if the supervisor had started
it then: its own process group, the run's marker variable, SIGKILL when the
flow's process dies, stdout and stderr into the run's log files.

A warm child not taken (staging failed or was cancelled, no time left, a
command instead of an entrypoint) is killed by :func:`discard`; a warm
child whose flow process dies gets SIGKILL from the kernel (or EOF on its
stdin) and exits.  Only the first attempt of a run uses one: a retry starts
its child as before.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from e31.tasks.supervisor.process import TOKEN_VAR, die_with_parent, set_subreaper
from e31.tasks.work.context import ChildConfig, command_environment

#: Set to ``0`` to start every child only when its run begins (to compare, or to rule it out).
ENABLED_VAR = "E31_PRESTART"


@dataclass
class WarmChild:
    """A started child waiting for its go: ``proc`` (stdin a pipe),
    ``token`` (the run's marker variable value), ``spawned_at`` (Unix s)."""

    proc: subprocess.Popen
    token: str
    spawned_at: float


_WARM: dict[str, WarmChild] = {}  # run folder -> its warm child
_LOCK = threading.Lock()


def child_environment(cfg: ChildConfig, token: str) -> dict[str, str]:
    """The whole environment of a Python child: this process's, the
    ``E31_*`` variables of ``cfg``, ``PYTHONPATH`` with ``cfg.code_dirs``
    first, and the run marker ``token``."""
    env = {**os.environ, **command_environment(cfg)}
    env["PYTHONPATH"] = os.pathsep.join([*cfg.code_dirs, env.get("PYTHONPATH", "")]).strip(os.pathsep)
    env[TOKEN_VAR] = token
    return env


def open_log(path: Path) -> int:
    """A fresh log file opened for appending (so a cap that cuts it back
    leaves the child writing at the new end), readable by its owner only
    (it holds the work's output unmasked); returns its descriptor."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return fd


#: The warm child's logs until a run takes it (then renamed onto the run's): an earlier run's
#: logs stay whole when this run ends before its work starts.
WARM_LOGS = {"stdout.log": "stdout.warm.log", "stderr.log": "stderr.warm.log"}


def spawn(command: list[str], cwd: str, env: dict[str, str], run_dir: Path, stdin=None,
          warm: bool = False) -> subprocess.Popen:
    """Start a work's child: its own process group (signals reach the whole
    tree), SIGKILL when the creating thread's process dies (main thread
    only), stdout and stderr into fresh ``stdout.log`` / ``stderr.log`` in
    ``run_dir`` (``warm``: into :data:`WARM_LOGS`, and this process becomes
    the reaper of orphans only when the run starts).  Raises ``OSError``
    when the command cannot be started."""
    if not warm:
        set_subreaper()  # orphans of the work are re-parented here, not to init
    names = WARM_LOGS if warm else {name: name for name in WARM_LOGS}
    out = open_log(run_dir / names["stdout.log"])
    try:
        err = open_log(run_dir / names["stderr.log"])
    except OSError:
        os.close(out)
        raise
    try:
        return subprocess.Popen(
            command, cwd=cwd, env=env, stdout=out, stderr=err, stdin=stdin, start_new_session=True,
            preexec_fn=die_with_parent if threading.current_thread() is threading.main_thread() else None,
        )
    finally:
        os.close(out)
        os.close(err)


def prestart(cfg: ChildConfig, run_dir: str) -> WarmChild | None:
    """Start the child of a Python entrypoint now, before its inputs are
    staged (the ``e31`` command does it before even the flow run starts);
    the one already waiting for ``run_dir`` when there is one.  None for a
    command, when ``E31_PRESTART=0``, or when it cannot start (the run then
    starts its child as usual and reports why)."""
    if cfg.command or not cfg.entrypoint or os.environ.get(ENABLED_VAR, "1") == "0":
        return None
    with _LOCK:
        waiting = _WARM.get(str(Path(run_dir)))
    if waiting is not None and waiting.proc.poll() is None:
        return waiting
    folder = Path(run_dir)
    token = uuid.uuid4().hex
    env = child_environment(cfg, token)
    env["E31_RESUME_DIR"] = ""  # not known yet (a fresh start clears the checkpoints): set at the go
    try:
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "child.json"
        cfg.write(config)  # the entrypoint, code folders and threads; rewritten in full at the go
        # (in the run folder: the output folder may not exist yet; the child moves there at its go)
        proc = spawn([sys.executable, "-m", "e31.tasks.work.child", "--warm", str(config)], str(folder), env,
                     folder, stdin=subprocess.PIPE, warm=True)
    except OSError:
        return None
    warm = WarmChild(proc=proc, token=token, spawned_at=time.time())
    with _LOCK:
        old = _WARM.pop(str(folder), None)
        _WARM[str(folder)] = warm
    if old is not None:
        kill(old)
    return warm


def warm_tokens() -> set[str]:
    """The run markers (``E31_WORK_TOKEN`` values) of the live warm children
    of this process: they and what they started are not leftovers of an
    earlier attempt, whatever else their environment says."""
    with _LOCK:
        return {w.token for w in _WARM.values() if w.proc.poll() is None}


def import_torch_here() -> None:
    """Import torch in this (the supervisor's) process in the background,
    from the run's start: it turns a Python work's handed-over checkpoints
    into ``state.pt`` files (:mod:`e31.tasks.work.local_checkpoints`), and a
    first import in the supervisor loop held it for about a second, often
    just as the work ended.  Not earlier: measured, an import running while
    ``e31 run`` creates its flow run slowed that by ~1 s (the GIL)."""
    def load() -> None:
        try:
            import torch  # noqa: F401
        except Exception:
            pass

    if "torch" not in sys.modules:
        threading.Thread(target=load, name="e31-import-torch", daemon=True).start()


def take(run_dir: str) -> WarmChild | None:
    """The live warm child of ``run_dir`` for the supervisor to start (once),
    its logs renamed onto the run's; None when there is none, or when it
    died while waiting (killed, out of memory): the run starts a new one."""
    with _LOCK:
        warm = _WARM.pop(str(Path(run_dir)), None)
    if warm is None:
        return None
    if warm.proc.poll() is not None:
        kill(warm)
        for warm_name in WARM_LOGS.values():
            (Path(run_dir) / warm_name).unlink(missing_ok=True)
        return None
    for name, warm_name in WARM_LOGS.items():  # the child's descriptors follow the rename
        os.replace(Path(run_dir) / warm_name, Path(run_dir) / name)
    return warm


def go(warm: WarmChild, env: dict[str, str]) -> None:
    """Let the warm child run the work in exactly ``env`` (the whole
    environment a child started now would get).  Written from a thread: a
    child still importing does not hold the supervisor, whose clock, cancel
    and signals apply from now.  A child gone meanwhile is found by the
    supervisor (its exit code, its stderr)."""
    def send() -> None:
        try:
            warm.proc.stdin.write((json.dumps(env) + "\n").encode())
            warm.proc.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass

    threading.Thread(target=send, name="e31-go", daemon=True).start()


def discard(run_dir: str) -> None:
    """Kill the warm child of ``run_dir`` if no run took it (the run's
    logs stay those of the run before)."""
    with _LOCK:
        warm = _WARM.pop(str(Path(run_dir)), None)
    if warm is not None:
        kill(warm)
        for warm_name in WARM_LOGS.values():
            (Path(run_dir) / warm_name).unlink(missing_ok=True)


def kill(warm: WarmChild) -> None:
    """SIGKILL a warm child (and its process group) and reap it."""
    if warm.proc.returncode is None:  # (once reaped, its pid may be another process's)
        try:
            os.killpg(warm.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        warm.proc.stdin.close()
    except (OSError, ValueError):
        pass
    warm.proc.wait()
