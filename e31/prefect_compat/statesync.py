"""Set a flow run's Prefect state from its manifest once the API answers.

When the Prefect API dies mid-job, E31 still stops the work, returns the
output and writes the manifest (the destination is the job's word, not the
API).  The flow run's state, which only the API holds, is then left as it
was (``Running``).  :func:`remember` keeps what it should be in
``<scratch>/<job>/flow-run-state.json``; :func:`apply_pending` -- run by the
next ``e31 run`` or ``e31 return`` on this machine that reaches an API --
sets it and removes the record.

Measured on Prefect 3.9.1: a flow run whose process lost the API keeps the
last state the server took until something sets another.  Upstream offers
the runner's heartbeats (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``) and an
automation that marks a silent run ``Crashed``: a state, but not the one the
manifest says; nothing upstream keeps a state to set once the API is back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from e31.states import from_record, manifest_state
from e31.tasks.manifest_model import ManifestHead

RECORD = "flow-run-state.json"


def state_of(manifest: dict[str, Any]) -> dict[str, str]:
    """The Prefect state a manifest's verdict maps to: ``completed`` ->
    Completed, ``partial`` -> Completed named Partial, ``partial`` with reason
    ``cancelled`` -> Cancelled, ``failed`` -> Failed (``type``, ``name``, ``message``).
    ``manifest``: a manifest's dict, or the part of one with ``status``, ``reason`` and ``message``
    (:class:`e31.tasks.manifest_model.ManifestHead`).  The map is :func:`e31.states.manifest_state`."""
    return manifest_state(manifest)


def remember(scratch: Path, manifest: dict[str, Any]) -> Path | None:
    """Record the state the flow run named by ``manifest``'s ``run_id`` must end in;
    returns the record's path (None without a run id)."""
    run_id = ManifestHead.of(manifest).run_id
    if not run_id:
        return None
    path = Path(scratch) / RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"run_id": run_id, **state_of(manifest)}))
    os.replace(tmp, path)
    return path


def apply_pending(scratch_root: Path) -> list[str]:
    """Set the recorded state of every job under ``scratch_root`` whose
    record is there (forcing it over ``Running``, or ``Crashed``: the
    process was killed, and its output is now delivered); returns the flow
    run ids set.  A record the API does not take now stays for a later try."""
    from prefect.client.orchestration import get_client

    done = []
    for path in sorted(Path(scratch_root).glob(f"*/{RECORD}")):
        try:
            record = json.loads(path.read_text())
            with get_client(sync_client=True) as client:
                current = client.read_flow_run(record["run_id"]).state
                if current is None or not current.is_final() or current.is_crashed():
                    client.set_flow_run_state(record["run_id"], from_record(record), force=True)
            path.unlink()
            done.append(record["run_id"])
        except Exception:  # the API is still away, or the run is gone: try again next time
            continue
    return done


def settle_earlier_run(scratch: Path, manifest: dict[str, Any]) -> None:
    """A return an earlier run could not finish was just delivered: set that
    run's flow run (left ``Running`` when its process was killed) to the
    manifest's state now, or when an API answers again."""
    if remember(scratch, manifest) is not None:
        apply_pending(Path(scratch).parent)
