"""e31/states.py is the one module that builds Prefect states.

The scan fails when any other product module calls a Prefect state
constructor (``State``, ``Completed``, ``Failed``, ... imported from Prefect);
the unit tests pin each builder to the exact type, name and message its
callers wrote before they called it.
"""

from __future__ import annotations

import ast
from datetime import datetime, timezone
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The product's source folders (the e31 package's subpackages).
PRODUCT = ("e31", "specs", "tasks", "flows", "deployments", "examples")
#: Prefect's state constructors (prefect.states; State also from prefect.client.schemas.objects).
CONSTRUCTORS = {"State", "Completed", "Failed", "Cancelled", "Crashed", "Scheduled", "Pending", "Running",
                "Cancelling", "Paused", "Suspended", "AwaitingRetry", "AwaitingConcurrencySlot", "Retrying", "Late"}
#: The module that builds them.
BUILDER = "e31/states.py"
#: Modules that may still build states themselves: none.
ALLOWED: set[str] = set()


def _constructor_calls(path: Path) -> list[str]:
    """``line: call`` for each call of a Prefect state constructor in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()  # local names bound to a constructor
    modules: set[str] = set()  # local names bound to a Prefect module that holds constructors
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prefect"):
            for alias in node.names:
                if alias.name in CONSTRUCTORS:
                    names.add(alias.asname or alias.name)
                elif alias.name in ("states", "objects"):
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("prefect"):
                    modules.add(alias.asname or alias.name.split(".")[0])
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in names:
            found.append(f"{node.lineno}: {func.id}(")
        elif isinstance(func, ast.Attribute) and func.attr in CONSTRUCTORS:
            base = func.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"{node.lineno}: {ast.unparse(func)}(")
    return found


def test_only_e31_states_builds_prefect_states():
    calls = {}
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == BUILDER or rel in ALLOWED:
                continue
            found = _constructor_calls(path)
            if found:
                calls[rel] = found
    assert calls == {}, "build these states with e31.states (e31/states.py) instead: " + repr(calls)


def test_allowed_modules_still_build_states():
    # a module on the allow-list that no longer builds states comes off it
    assert {rel for rel in ALLOWED if _constructor_calls(ROOT / rel)} == ALLOWED


def test_the_scan_sees_each_way_of_calling_a_constructor(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from prefect.states import Failed as F, State\n"
                      "import prefect.states\n"
                      "from prefect import states as ps\n"
                      "from prefect.client.schemas.filters import FlowRunFilterState\n"
                      "F(message='x')\n"
                      "State(type=1)\n"
                      "prefect.states.Crashed(message='y')\n"
                      "ps.Pending()\n"
                      "FlowRunFilterState()\n")
    assert _constructor_calls(source) == ["5: F(", "6: State(", "7: prefect.states.Crashed(", "8: ps.Pending("]


WHEN = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def _words(state):
    return state.type.value, state.name, state.message


def test_queued_and_placed():
    from e31.states import placed, queued

    q, p = queued("Queued: waiting for the scheduler to place it", WHEN), placed("fits on n1", WHEN)
    assert _words(q) == ("SCHEDULED", "Queued", "Queued: waiting for the scheduler to place it")
    assert q.state_details.scheduled_time == WHEN
    assert _words(p) == ("SCHEDULED", "Placed", "fits on n1")
    assert p.state_details.scheduled_time == WHEN


def test_returning_refused_and_endings():
    from e31.states import cancelled, cancelling, crashed, failed, partial, refused, refused_busy, returning

    assert _words(returning("its worker finishes the return")) == (
        "PENDING", "Returning", "its worker finishes the return")
    assert _words(refused("it needs 9 GPUs")) == ("FAILED", "Failed", "refused: it needs 9 GPUs")
    busy = ValueError("job held")
    refusal = refused_busy("job held by run 1", data=busy)
    assert _words(refusal) == ("CANCELLED", "Refused", "refused: job held by run 1")
    assert refusal.data is busy
    assert _words(cancelled("cancelled while queued (e31 cancel)")) == (
        "CANCELLED", "Cancelled", "cancelled while queued (e31 cancel)")
    assert _words(cancelling("cancel requested (e31 cancel)")) == (
        "CANCELLING", "Cancelling", "cancel requested (e31 cancel)")
    assert _words(crashed("its flow process is gone")) == ("CRASHED", "Crashed", "its flow process is gone")
    fail = failed("bad spec", data="raised")
    assert _words(fail) == ("FAILED", "Failed", "bad spec")
    assert fail.data == "raised"
    part = partial("partial (time_limit): the work; stopped", data={"status": "partial"})
    assert _words(part) == ("COMPLETED", "Partial", "partial (time_limit): the work; stopped")
    assert part.data == {"status": "partial"}


def test_copy_of_keeps_type_name_and_message_only():
    from e31.states import copy_of, crashed

    before = crashed("lost")
    again = copy_of(before)
    assert _words(again) == ("CRASHED", "Crashed", "lost")
    assert again.id != before.id


@pytest.mark.parametrize("head, want", [
    ({"status": "completed", "reason": "finished", "message": "all 3 files"},
     {"type": "COMPLETED", "name": "Completed", "message": "all 3 files"}),
    ({"status": "completed", "reason": "finished"},
     {"type": "COMPLETED", "name": "Completed", "message": "completed (finished)"}),
    ({"status": "partial", "reason": "cancelled", "message": "stopped"},
     {"type": "CANCELLED", "name": "Cancelled", "message": "stopped"}),
    ({"status": "partial", "reason": "time_limit", "message": "stopped at the limit"},
     {"type": "COMPLETED", "name": "Partial", "message": "partial (time_limit): stopped at the limit"}),
    ({"status": "failed", "reason": "error", "message": "ZeroDivisionError"},
     {"type": "FAILED", "name": "Failed", "message": "ZeroDivisionError"}),
])
def test_the_one_manifest_to_state_map(head, want):
    from e31.prefect_compat.statesync import state_of
    from e31.states import for_manifest, from_record, manifest_state

    assert manifest_state(head) == want
    assert state_of(head) == want  # the record's map is the same one
    assert _words(for_manifest(head)) == (want["type"], want["name"], want["message"])
    assert _words(from_record({"run_id": "r", **want})) == (want["type"], want["name"], want["message"])


def test_state_names_stay_importable_where_they_were():
    from e31.deployments.cutreturn import RETURNING as CUT
    from e31.flows.queue import PLACED, QUEUED
    from e31.flows.queue.mapping import PLACED as MAPPED_PLACED, QUEUED as MAPPED_QUEUED
    from e31.flows.queue.snapshot import RETURNING as SEEN
    from e31 import states

    assert (QUEUED, PLACED, MAPPED_QUEUED, MAPPED_PLACED) == ("Queued", "Placed", "Queued", "Placed")
    assert (CUT, SEEN) == ("Returning", "Returning")
    assert (states.QUEUED, states.PLACED, states.RETURNING, states.PARTIAL, states.REFUSED) == (
        "Queued", "Placed", "Returning", "Partial", "Refused")
