"""A Python entrypoint for the meter tests that never uses torch (imported
by the child through ``run_job(..., code_dir=<this folder>)``).

Its module sleeps ``IMPORT_S`` seconds as it is imported, standing in for a
work's heavy imports (the child's start, which the meter does not bill).
``work`` writes ``result.json``: ``torch_loaded`` (whether torch is in the
child's ``sys.modules`` when the function is called), and ``started`` and
``ended`` (Unix seconds, the work's own measure) around a sleep of
``params.work_s`` seconds (1.0).
"""

from __future__ import annotations

import json
import sys
import time

IMPORT_S = 2.0
time.sleep(IMPORT_S)


def work(ctx) -> None:
    started = time.time()
    torch_loaded = "torch" in sys.modules
    time.sleep(float(ctx.params.get("work_s", 1.0)))
    ended = time.time()
    (ctx.output_dir / "result.json").write_text(json.dumps(
        {"torch_loaded": torch_loaded, "started": started, "ended": ended}))
