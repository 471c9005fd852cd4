"""Test support, never installed: a process that has this folder on
``PYTHONPATH`` and ``E31_TEST_HOLD=<status>`` in its environment stops
itself (a real ``SIGSTOP``) right after it writes a destination's
``manifest.json`` with that status: ``returning`` (the return begins,
:meth:`e31.tasks.destination.Destination.withdraw`) or ``completed`` /
``partial`` / ``failed`` (the return's last write,
:meth:`~e31.tasks.destination.Destination.publish_manifest`).

A test that must act between two writes of a flow process (a cancel
after the manifest and before the final state; a kill in the middle of a
return) cannot win that race by polling from outside on a loaded
machine: the state write is already in flight when the poll sees the
manifest.  Held here, the process has done the first write and not begun
the next; the test finds it stopped (:func:`tests.hold.stopped`) and lets
it go with ``SIGCONT`` or kills it.  Python imports ``sitecustomize`` at
start-up from the first folder on its path that has one, so the worker,
its warm process and every flow process it forks carry the hold; only
the first write of the status, by any of them, holds (the file named by
``E31_TEST_HOLD_MARK`` records that the hold is spent).
"""

from __future__ import annotations

import os

_STATUS = os.environ.get("E31_TEST_HOLD")


def _install(status: str) -> None:
    import importlib.abc
    import signal
    import sys

    target = "e31.tasks.destination"
    mark = os.environ["E31_TEST_HOLD_MARK"]

    def hold() -> None:
        try:  # the first process to write the status holds; the worker that finishes a cut return does not
            os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGSTOP)

    def patch(module) -> None:
        withdraw, publish = module.Destination.withdraw, module.Destination.publish_manifest

        def held_withdraw(self, *args, **kwargs):
            withdraw(self, *args, **kwargs)
            if status == "returning":
                hold()

        def held_publish(self, manifest, *args, **kwargs):
            publish(self, manifest, *args, **kwargs)
            if manifest.get("status") == status:
                hold()

        module.Destination.withdraw, module.Destination.publish_manifest = held_withdraw, held_publish

    class AfterImport(importlib.abc.MetaPathFinder):
        """Patches the destination module once it has been executed."""

        def find_spec(self, name, path, target_=None):
            if name != target:
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target_)
                if spec is not None:
                    break
            else:
                return None
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, AfterImport())


if _STATUS:
    _install(_STATUS)
