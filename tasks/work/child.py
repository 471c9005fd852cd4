"""Child-process entry point: ``python -m e31.tasks.work.child CONFIG.json``.

Imports the work's ``module:function`` entrypoint and calls it with a
:class:`e31.tasks.work.context.WorkContext`.  Exit codes: 0 when the function returned,
1 when it raised (traceback on stderr), 2 when the entrypoint cannot be
imported.  SIGTERM sets ``ctx.should_stop`` instead of killing the process.
"""

from __future__ import annotations

import importlib
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


def main(argv: list[str]) -> int:
    """Run the work described by the config file ``argv[0]``; returns the exit code."""
    cfg = ChildConfig.read(Path(argv[0]))
    ctx = WorkContext(cfg)
    ctx.install_signal_handlers()
    try:
        import torch

        torch.set_num_threads(max(1, cfg.cpus))
    except ImportError:  # torch is only needed by work that uses it
        pass
    try:
        func = load_entrypoint(cfg.entrypoint or "", cfg.code_dirs)
    except Exception as exc:
        print(f"e31: cannot load work.entrypoint {cfg.entrypoint!r}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_BAD_ENTRYPOINT
    # The moment the work's own code starts (for the manifest's child_start_s and work_s).
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
