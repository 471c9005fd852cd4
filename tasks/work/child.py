"""Child-process entry point: ``python -m e31.tasks.work.child [--warm] CONFIG.json``.

Imports the work's ``module:function`` entrypoint and calls it with a
:class:`e31.tasks.work.context.WorkContext`.  With ``--warm`` (started
while the inputs stage, :mod:`e31.tasks.supervisor.warm`) it imports the
entrypoint first, then waits for one line on stdin: the JSON of the
environment variables to set; it then reads CONFIG.json again (rewritten
in full) and runs the work.  EOF instead of that line: the run did not
happen; it exits 0 without running anything.  Exit codes: 0 when the function returned,
1 when it raised (traceback on stderr), 2 when the entrypoint cannot be
imported.  SIGTERM sets ``ctx.should_stop`` instead of killing the process.

The child imports torch only when the work needs it: its entrypoint's
module imports it, or the job declares a checkpoint policy (``every`` or
``every_steps``: its checkpoints are torch files, so torch is imported
with the entrypoint, before the work starts); else a checkpoint saved or
restored through the context imports it then.  A work that never uses
torch does not pay for it, and the meter (:mod:`e31.tasks.meter`) starts
only when the function is called.  torch's threads follow
``OMP_NUM_THREADS`` (= ``request.cpus``), which torch reads as it loads.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from e31.tasks.work.context import ChildConfig, WorkContext

EXIT_WORK_RAISED = 1
EXIT_BAD_ENTRYPOINT = 2


def load_entrypoint(spec: str, code_dirs: list[str]):
    """Import ``module:function`` (``code_dirs`` first on ``sys.path``) and
    return the callable.  Raises ``ImportError``/``AttributeError`` with the
    entrypoint named."""
    module_name, _, func_name = spec.partition(":")
    for folder in reversed(code_dirs):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    module = importlib.import_module(module_name)
    target = module
    for part in func_name.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{spec} is not callable")
    return target


def _load(cfg: ChildConfig, quiet: bool = False):
    """The entrypoint's callable, torch loaded first when the job declares
    a checkpoint policy; None (said on stderr unless ``quiet``) when the
    entrypoint cannot be loaded."""
    if cfg.checkpoint_every_s or cfg.checkpoint_every_steps:  # its checkpoints are torch files
        try:
            import torch  # noqa: F401
        except ImportError:  # said by the first checkpoint, which needs it
            pass
    try:
        return load_entrypoint(cfg.entrypoint or "", cfg.code_dirs)
    except Exception as exc:
        if not quiet:
            print(f"e31: cannot load work.entrypoint {cfg.entrypoint!r}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
        return None


def _wait_for_go() -> bool:
    """Block until the supervisor's go (True: the environment is now exactly
    the one it sent) or EOF (False).  The work then reads no stdin."""
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return False
    env = json.loads(line)
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return True


def main(argv: list[str]) -> int:
    """Run the work described by the config file ``argv[-1]`` (``--warm``
    first: load, then wait for the go); returns the exit code."""
    warm = argv[:1] == ["--warm"]
    path = Path(argv[-1])
    cfg = ChildConfig.read(path)
    stops: list[int] = []
    func = None
    if warm:  # a SIGTERM before the go is kept and becomes ctx.should_stop at once
        signal.signal(signal.SIGTERM, lambda signum, frame: stops.append(signum))
        func = _load(cfg, quiet=True)  # a failure is tried again below, in the run's environment and folder
        if not _wait_for_go():
            os._exit(0)  # no run: nothing of the work's (its atexit handlers) may run
        cfg = ChildConfig.read(path)
        os.chdir(cfg.output_dir)  # (a fresh start may have made the folder anew since this process began)
    ctx = WorkContext(cfg)
    ctx.install_signal_handlers()
    if stops:
        ctx._on_stop_signal(signal.SIGTERM, None)
    if func is None:
        func = _load(cfg)
        if func is None:
            return EXIT_BAD_ENTRYPOINT
    # The moment the work's own code starts: the meter's start (tasks/meter.py), child_start_s and work_s.
    Path(cfg.progress_file).with_name("begun").write_text(repr(time.time()))
    try:
        func(ctx)
    except Exception:
        traceback.print_exc()
        return EXIT_WORK_RAISED
    # Said before the interpreter's teardown (which can take a while with torch loaded): a hard stop
    # that lands now cuts only the teardown, and the supervisor counts the work as finished.
    Path(cfg.progress_file).with_name("returned").write_text("0")
    return 0


def quick_exit(code: int) -> None:
    """End the process without the interpreter's teardown of every module
    (about 0.5 s with torch loaded), keeping what that teardown owes the
    work: non-daemon threads are joined (as the interpreter's exit does
    first), the ``atexit`` handlers run (logging's flush, multiprocessing's
    joins, the work's own), then every Python file object still open is
    flushed, then stdout, stderr and C's stdio; then ``os._exit``.  Objects
    that finish a file only in ``__del__`` (an unclosed ``GzipFile`` or
    ``ZipFile`` left in a module global) are not finished: close them.  Python does not
    promise to run ``__del__`` of objects alive at exit (the data model's
    note on ``object.__del__``), so nothing the work may rely on is skipped."""
    import atexit
    import ctypes
    import gc
    import io
    import threading
    import warnings

    try:
        threading._shutdown()  # as the interpreter's exit does first: joins non-daemon threads (executors too)
        atexit._run_exitfuncs()
        warnings.simplefilter("ignore")  # (nothing of the scan below is the work's to hear about)
        for obj in gc.get_objects():
            if issubclass(type(obj), io.IOBase):  # type(): no __class__ property of a library object is read
                try:
                    if not obj.closed and obj.writable():
                        obj.flush()
                except Exception:
                    pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        try:
            ctypes.CDLL(None).fflush(None)  # C stdio buffers (a native library's printf) too
        except Exception:
            pass
        os._exit(code)


if __name__ == "__main__":
    quick_exit(main(sys.argv[1:]))
