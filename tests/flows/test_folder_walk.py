"""Issue 35: the walk from ``e31 run`` to the manifest crosses E31's folders at most 5 times.

``tests/flows/folder_walk.py`` runs ``e31 run`` of the SIR example in a process of its own with a
profiler on every thread and reports the deepest chain of E31 folders on any call stack (consecutive
frames of one folder merged; library frames between them not counted).  With the attempt owning the
run's life (``flows/attempt/``) the chain is ``flows -> specs -> flows -> tasks``: 3 crossings; the
run task reaching back up into ``flows`` (the old hand-over hook, cancel and fencing imports) would
add 2 for each trip.  The only calls from ``tasks`` up into ``flows`` are into what the attempt hands
the run task (its gates and its step callback, ``flows/attempt/``); before the attempt, the run task
also called the hand-over's ``release`` through a hook list and ``flows/runlog.py``'s log filter
(7 up-calls on this example, 2 now).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WALK = Path(__file__).with_name("folder_walk.py")
EXAMPLE = Path(__file__).resolve().parents[2] / "specs" / "examples" / "sir-sweep.yaml"


def test_the_run_crosses_folders_at_most_five_times(prefect_api, tmp_path):
    env = {**os.environ, "E31_SCRATCH": str(tmp_path / "scratch")}
    out = subprocess.run([sys.executable, str(WALK), str(EXAMPLE), str(tmp_path / "out")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    walk = json.loads(out.stdout.strip().splitlines()[-1])
    print(walk)
    assert walk["exit"] == 0
    assert walk["calls"] > 1000  # the profiler saw the run (a walk of nothing would pass the bound)
    assert "tasks" in walk["deepest"] and walk["max_crossings"] <= 5, walk
    up_into_flows = {target for target in walk["up_targets"] if target.startswith("flows/")}
    assert up_into_flows and all(t.startswith("flows/attempt/") or t.startswith("flows/checks.py:") for t in
                                 up_into_flows), walk["up_targets"]  # (checks: the spec loader's injected checks)
    assert not [t for t in walk["up_targets"] if t.startswith("deployments/") and ":<module>" not in t
                and "add_commands" not in t], walk["up_targets"]  # the CLI registers the queue's commands
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["status"] == "completed"
