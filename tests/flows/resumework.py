"""A work for the resume tests (copied beside its spec, whose folder
``e31 run`` puts first on the child's ``sys.path``).

``work`` counts ``params.n`` steps of ``params.step_s`` seconds from the
restored step, committing a checkpoint ``{"step": n}`` after each.  When
told to stop it writes ``partial.json`` (``{"step": n}``) and returns; once
every step is done it writes ``result.json`` (``{"step": n, "resumed_from":
the restored step or 0}``).  Both files are the work's own; only
``result.json`` is declared.
"""

from __future__ import annotations

import json
import time


def work(ctx) -> None:
    n, step_s = int(ctx.params.get("n", 30)), float(ctx.params.get("step_s", 0.2))
    restored = ctx.restore()
    start = int(restored[0]["step"]) if restored else 0
    for step in range(start + 1, n + 1):
        time.sleep(step_s)
        ctx.checkpoint({"step": step}, step, wait=True)
        ctx.progress(step, n)
        if ctx.should_stop and step < n:
            (ctx.output_dir / "partial.json").write_text(json.dumps({"step": step}))
            return
    (ctx.output_dir / "result.json").write_text(json.dumps({"step": n, "resumed_from": start}))
