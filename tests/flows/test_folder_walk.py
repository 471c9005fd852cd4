"""Issue 35: the walk from ``e31 run`` to the manifest crosses E31's folders at most 5 times.

``tests/flows/folder_walk.py`` runs ``e31 run`` of the SIR example in a process of its own with a
profiler on every thread and reports the deepest chain of E31 folders on any call stack (consecutive
frames of one folder merged; library frames between them not counted).  With the attempt owning the
run's life (``flows/attempt/``) the chain is ``flows -> specs -> flows -> tasks``: 3 crossings; the
run task reaching back up into ``flows`` (the old hand-over hook, cancel and fencing imports) would
add 2 for each trip.
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
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["status"] == "completed"
