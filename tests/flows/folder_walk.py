"""Run ``e31 run SPEC`` in this process and measure how often its call stacks cross E31's folders.

Every call of a function defined in E31's source (``e31/``, ``specs/``, ``tasks/``, ``flows/``,
``deployments/``) is seen (``sys.setprofile`` and ``threading.setprofile``: the flow run's task
threads too); for each, the E31 frames on its stack are read from the outside in, each named by its
folder, and consecutive frames of one folder are merged.  The number of crossings of a stack is
the number of folder changes along it: ``flows -> tasks -> flows`` is 2, one call down into
``tasks`` and one call back up.  Library frames between E31 frames (Prefect's engine calling a
task) do not count.  Work processes are children and are not seen: what is measured is the path
from the CLI to the manifest that a reader of E31's code follows.

Usage: ``python folder_walk.py SPEC OUTPUT_URL`` (with a Prefect API configured); prints one JSON
line ``{"exit": N, "max_crossings": N, "deepest": [folders...], "calls": N}``.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("e31", "specs", "tasks", "flows", "deployments")
_PREFIXES = {str(ROOT / name) + "/": name for name in FOLDERS}
_deepest: list[str] = []
_calls = 0


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
    global _deepest, _calls
    if event != "call" or _folder(frame.f_code.co_filename) is None:
        return
    _calls += 1
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
                      "calls": _calls}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
