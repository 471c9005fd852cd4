"""Run ``e31 run SPEC`` in this process and measure how often its call stacks cross E31's folders.

Every call of a function defined in E31's source (``e31/``, ``specs/``, ``tasks/``, ``flows/``,
``deployments/``) is seen (``sys.setprofile`` and ``threading.setprofile``: the flow run's task
threads too); for each, the E31 frames on its stack are read from the outside in, each named by its
folder, and consecutive frames of one folder are merged.  The number of crossings of a stack is
the number of folder changes along it: ``flows -> tasks -> flows`` is 2, one call down into
``tasks`` and one call back up.  Library frames between E31 frames (Prefect's engine calling a
task) do not count.  Work processes are children and are not seen: what is measured is the path
from the CLI to the manifest that a reader of E31's code follows.

It also counts *up-calls*: calls from a lower layer into a higher one, the layers being ``e31`` <
``specs`` < ``tasks`` < ``flows`` < ``deployments`` (a hook list or callback a lower folder calls into a
higher one), by ``caller -> callee`` and by the callee's function.

Usage: ``python folder_walk.py SPEC OUTPUT_URL`` (with a Prefect API configured); prints one JSON
line ``{"exit": N, "max_crossings": N, "deepest": [folders...], "calls": N, "up_calls": {...},
"up_targets": {...}}``.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("e31", "specs", "tasks", "flows", "deployments")
_PREFIXES = {str(ROOT / name) + "/": name for name in FOLDERS}
LAYER = {name: i for i, name in enumerate(FOLDERS)}
_deepest: list[str] = []
_calls = 0
_up: dict[str, int] = {}
_up_targets: dict[str, int] = {}


def _folder(filename: str) -> str | None:
    for prefix, name in _PREFIXES.items():
        if filename.startswith(prefix):
            return name
    return None


def _chain(frame) -> list[str]:
    chain: list[str] = []
    while frame is not None:
        name = _folder(frame.f_code.co_filename)
        if name is not None and (not chain or chain[-1] != name):
            chain.append(name)
        frame = frame.f_back
    chain.reverse()
    return chain


def _profile(frame, event, arg):
    global _deepest, _calls  # (the dicts are mutated in place)
    if event != "call" or _folder(frame.f_code.co_filename) is None:
        return
    _calls += 1
    callee = _folder(frame.f_code.co_filename)
    caller = frame.f_back
    while caller is not None and _folder(caller.f_code.co_filename) is None:
        caller = caller.f_back
    if caller is not None and LAYER[_folder(caller.f_code.co_filename)] < LAYER[callee]:
        edge = f"{_folder(caller.f_code.co_filename)} -> {callee}"
        _up[edge] = _up.get(edge, 0) + 1
        target = f"{frame.f_code.co_filename[len(str(ROOT)) + 1:]}:{frame.f_code.co_name}"
        _up_targets[target] = _up_targets.get(target, 0) + 1
    chain = _chain(frame)
    if len(chain) > len(_deepest):
        _deepest = chain


def main(argv: list[str]) -> int:
    spec, output_url = argv
    from e31.flows.cli import main as cli

    threading.setprofile(_profile)
    sys.setprofile(_profile)
    try:
        code = cli(["run", spec, "--set", f"output.url={output_url}"])
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    print(json.dumps({"exit": code, "max_crossings": max(len(_deepest) - 1, 0), "deepest": _deepest,
                      "calls": _calls, "up_calls": _up, "up_targets": _up_targets}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
