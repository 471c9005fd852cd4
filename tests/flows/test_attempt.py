"""The attempt (:mod:`e31.flows.attempt`): its steps, its step label on the
flow run as ``e31 queue`` shows it, and the shape it gives the code: a thin
``run_job``, one delivery path, and tasks that never call up into flows."""

from __future__ import annotations

import ast
import time
from pathlib import Path
from types import SimpleNamespace

from e31.deployments.runwords import holding
from e31.flows.attempt import Step
from e31.flows.attempt.steplabel import STEP_LABEL, StepLabel

ROOT = Path(__file__).resolve().parents[2]


def _e31_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
            and node.module.startswith("e31")}


def test_the_steps_are_the_attempts_in_order():
    assert [s.value for s in Step] == ["admit", "scratch", "deliver pending", "stage", "gates", "run", "return",
                                       "settle"]


def test_run_job_is_a_thin_wrapper_of_the_attempt():
    assert _e31_imports(ROOT / "flows" / "job.py") == {"e31.flows.attempt", "e31.flows.cancelhook",
                                                      "e31.flows.deploy", "e31.specs"}


def test_every_return_goes_through_the_one_delivery_path():
    callers = set()
    for path in [*ROOT.glob("tasks/**/*.py"), *ROOT.glob("flows/**/*.py"), *ROOT.glob("deployments/**/*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "deliver":
                callers.add(path.relative_to(ROOT).as_posix())
    # deliver.py's own use: the failed manifest written with no files (write_failure_manifest)
    assert callers == {"tasks/returning.py", "tasks/deliver.py"}


def test_tasks_never_import_flows():
    for path in ROOT.glob("tasks/**/*.py"):
        source = path.read_text()
        assert not [m for m in _e31_imports(path) if m.startswith("e31.flows")], path
        assert "ON_DELIVERED" not in source, path


def test_the_supervisor_is_given_its_gates_not_importing_them():
    imported = _e31_imports(ROOT / "tasks" / "supervisor" / "loop.py")
    assert not imported & {"e31.tasks.supervisor.cancel", "e31.tasks.supervisor.fence", "e31.flows.queue.handover"}


def test_e31_queue_names_the_step_of_a_running_run():
    running = SimpleNamespace(type=SimpleNamespace(value="RUNNING"), name="Running")
    assert holding(running) == "running"
    assert holding(running, {STEP_LABEL: "run"}) == "running"
    assert holding(running, {STEP_LABEL: "stage"}) == "running: staging its inputs"
    assert holding(running, {STEP_LABEL: "gates"}) == "running: checking it may start its work"
    assert holding(running, {STEP_LABEL: "return"}) == "running: returning its output"


def test_the_step_label_reaches_the_flow_run(prefect_api, monkeypatch):
    from prefect import flow
    from prefect.client.orchestration import get_client

    @flow(name="e31-step-label-test")
    def nothing() -> None:
        pass

    monkeypatch.setenv("E31_NODE", "n1")  # written on a queue's node only
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(nothing)
        label = StepLabel(str(run.id))
        for step in (Step.ADMIT, Step.STAGE, Step.GATES, Step.RUN):
            label.show(step)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (client.read_flow_run(run.id).labels or {}).get(STEP_LABEL) != "run":
            time.sleep(0.2)
        assert client.read_flow_run(run.id).labels.get(STEP_LABEL) == "run"
        monkeypatch.delenv("E31_NODE")
        other = client.create_flow_run(nothing)
        quiet = StepLabel(str(other.id))
        quiet.show(Step.RUN)  # off a queue: nothing written, no thread started
        assert quiet._thread is None
        assert STEP_LABEL not in (client.read_flow_run(other.id).labels or {})
