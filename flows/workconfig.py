"""What the work's child is told: its :class:`ChildConfig`, from the spec
and the compiled plan.  No Prefect import (``e31 run`` starts the child
before it loads Prefect)."""

from __future__ import annotations

import os

from e31.flows.compile import JobPlan
from e31.specs import JobSpec
from e31.tasks.work.context import ChildConfig


def child_config(spec: JobSpec, plan: JobPlan, staged: dict[str, str], code_dir: str | None) -> ChildConfig:
    """What the work's child is told (:class:`ChildConfig`): ``staged`` maps
    input names to their local copies ({} for a child started before
    staging, :mod:`e31.tasks.supervisor.warm`); ``code_dir`` goes first on
    its ``sys.path``."""
    return ChildConfig(
        entrypoint=spec.work.entrypoint,
        command=spec.work.command,
        params=dict(spec.work.params),
        data=staged,
        output_dir=str(plan.output_dir),
        checkpoint_dir=str(plan.checkpoint_dir),
        progress_file=str(plan.run_dir / "progress.json"),
        device=plan.device,
        cpus=plan.cpus,
        gpus=plan.gpus,
        devices=placed_devices(plan.gpus),
        code_dirs=[code_dir] if code_dir else [],
        checkpoint_every_s=plan.checkpoint_every_s,
        checkpoint_every_steps=plan.checkpoint_every_steps,
        supervised=True,
    )


def placed_devices(gpus: int) -> list[int] | None:
    """The GPU devices a scheduler placed this run on (``E31_GPU_DEVICES``,
    set by ``e31 worker``: e.g. ``4,5``), or None to use ``0 .. gpus-1``."""
    text = os.environ.get("E31_GPU_DEVICES")
    if text is None:
        return None
    devices = [int(d) for d in text.split(",") if d.strip().isdigit()]
    return devices[:gpus] if gpus else []
