"""The checkpoint format: atomic commit, marker last, torn and tampered
checkpoints ignored, weights_only enforced."""

from __future__ import annotations

import collections
import json
import os

import pytest
import torch

from e31.tasks.work.local_checkpoints import (
    MARKER,
    STATE_FILE,
    CheckpointError,
    committed,
    latest_valid,
    load_state,
    save_state,
    verify,
)
from e31.tasks.work.context import WorkContext


def test_save_commits_folder_with_marker_hashes(tmp_path):
    ckpt = save_state(tmp_path, {"w": torch.arange(4.0), "epoch": 3}, step=3)
    assert ckpt.path == tmp_path / "step-3" and ckpt.step == 3
    assert sorted(p.name for p in ckpt.path.iterdir()) == [MARKER, "PENDING", STATE_FILE]
    marker = json.loads((ckpt.path / MARKER).read_text())
    data = (ckpt.path / STATE_FILE).read_bytes()
    import hashlib

    assert marker == {"step": 3, "files": {STATE_FILE: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}
    state = load_state(ckpt.path / STATE_FILE)
    assert state["epoch"] == 3 and torch.equal(state["w"], torch.arange(4.0))
    # no temporary folders left behind
    assert [p.name for p in tmp_path.iterdir()] == ["step-3"]


def test_folder_without_marker_is_not_a_checkpoint(tmp_path):
    save_state(tmp_path, {"x": 1}, step=1)
    save_state(tmp_path, {"x": 2}, step=2)
    (tmp_path / "step-2" / MARKER).unlink()  # as if killed before the marker was written
    assert [c.step for c in committed(tmp_path)] == [1]
    assert latest_valid(tmp_path).step == 1


def test_tampered_checkpoint_falls_back_to_previous(tmp_path):
    save_state(tmp_path, {"x": 1}, step=1)
    save_state(tmp_path, {"x": 2}, step=2)
    with open(tmp_path / "step-2" / STATE_FILE, "r+b") as fh:
        fh.seek(10)
        fh.write(b"\x00\x01\x02")
    assert verify(tmp_path / "step-2") is None
    assert latest_valid(tmp_path).step == 1


def test_truncated_checkpoint_is_ignored(tmp_path):
    save_state(tmp_path, {"x": torch.zeros(100)}, step=5)
    path = tmp_path / "step-5" / STATE_FILE
    os.truncate(path, path.stat().st_size // 2)
    assert latest_valid(tmp_path) is None


def test_empty_marker_from_a_command_is_accepted(tmp_path):
    folder = tmp_path / "step-7"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"abc")
    (folder / MARKER).write_text("")
    marker = verify(folder)
    assert marker["step"] == 7
    assert marker["files"]["weights.bin"]["bytes"] == 3


class Opaque:
    def __init__(self):
        self.v = 1


def test_state_needing_arbitrary_classes_is_refused(tmp_path):
    with pytest.raises(CheckpointError) as err:
        save_state(tmp_path, {"obj": Opaque()}, step=1)
    assert str(err.value) == (
        "state['obj']: a tests.tasks.test_checkpoints.Opaque is not a tensor or plain value, so "
        "torch.load(weights_only=True) could not read it back. Fix: checkpoint tensors and plain values only "
        "(e.g. model.state_dict(), optimizer.state_dict(), numbers, lists, dicts; numpy arrays via "
        "torch.from_numpy), not whole objects."
    )
    assert committed(tmp_path) == []  # nothing committed
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize("handoff", [True, False])
def test_subclasses_of_plain_types_are_refused_before_anything_is_written(tmp_path, handoff):
    """numpy scalars subclass float, an IntEnum int: torch.load(weights_only=True)
    could not read them back, so a checkpoint holding one would make the job
    unresumable; they are refused at ctx.checkpoint, naming the entry."""
    import enum

    import numpy as np

    from e31.tasks.work.local_checkpoints import write_state

    class Mode(enum.IntEnum):
        TRAIN = 1

    class LocalFloat(float):
        pass

    for bad, where, kind in (({"lr": np.float64(0.1)}, "state['lr']", "numpy.float64"),
                             ({"m": [Mode.TRAIN]}, "state['m'][0]", f"{__name__}.test_subclasses_of_plain_types_are_"
                                                                    "refused_before_anything_is_written.<locals>.Mode"),
                             ({"x": {"y": LocalFloat(2.0)}}, "state['x']['y']", f"{__name__}.test_subclasses_of_plain_"
                              "types_are_refused_before_anything_is_written.<locals>.LocalFloat")):
        with pytest.raises(CheckpointError) as err:
            write_state(tmp_path, bad, 1, handoff=handoff)
        assert str(err.value).startswith(f"{where}: a {kind} is not a tensor or plain value, so "
                                         "torch.load(weights_only=True) could not read it back.")
    with pytest.raises(CheckpointError, match=r"^state: key np\.int64\(2\) is a int64; use str or int keys$"):
        write_state(tmp_path, {np.int64(2): 1}, 1, handoff=handoff)
    assert list(tmp_path.iterdir()) == []


def test_plain_containers_round_trip(tmp_path):
    state = {"od": collections.OrderedDict(a=torch.ones(2)), "lst": [1, 2.5, "x"], "t": (1, 2)}
    save_state(tmp_path, state, step=4)
    back = load_state(tmp_path / "step-4" / STATE_FILE)
    assert back["lst"] == [1, 2.5, "x"] and back["t"] == (1, 2) and torch.equal(back["od"]["a"], torch.ones(2))


def test_context_restore_and_checkpoint_due(tmp_path):
    ctx = WorkContext.local({}, tmp_path / "out", checkpoint_dir=tmp_path / "ck")
    assert ctx.restore() is None
    ctx.checkpoint({"step": torch.tensor(9)}, step=9)
    state, step = ctx.restore()
    assert step == 9 and int(state["step"]) == 9
    assert ctx.checkpoint_due(9) is False  # no policy: only when the work decides
    ctx._cfg.checkpoint_every_steps = 3
    assert [ctx.checkpoint_due(s) for s in (1, 2, 3, 6, 7)] == [False, False, True, True, False]


def test_upload_verifies_and_keeps_newest(tmp_path):
    from e31.tasks.checkpoint import latest_durable, upload

    local, durable = tmp_path / "local", tmp_path / "durable"
    for step in range(1, 6):
        ckpt = save_state(local, {"step": step, "w": torch.full((3,), float(step))}, step=step)
        record = upload(ckpt.path, str(durable), keep=3, work_sha256="w" * 64, run_id="run-1")
        assert record.step == step and record.url == str(durable / f"step-{step}")
        assert record.bytes == (ckpt.path / STATE_FILE).stat().st_size
    assert sorted(p.name for p in durable.iterdir()) == ["step-3", "step-4", "step-5"]
    for step in (3, 4, 5):
        local_marker = json.loads((local / f"step-{step}" / MARKER).read_text())
        assert json.loads((durable / f"step-{step}" / MARKER).read_text()) == {**local_marker, "work_sha256": "w" * 64,
                                                                                "run_id": "run-1"}
        assert verify(durable / f"step-{step}") is not None
    newest = latest_durable(str(durable))
    assert (newest.step, newest.work_sha256, newest.run_id) == (5, "w" * 64, "run-1")
    assert load_state(durable / "step-5" / STATE_FILE)["step"] == 5


def test_upload_refuses_a_torn_checkpoint(tmp_path):
    from e31.tasks.checkpoint import upload

    ckpt = save_state(tmp_path / "local", {"x": 1}, step=2)
    (ckpt.path / MARKER).unlink()
    with pytest.raises(ValueError, match="is not a committed checkpoint"):
        upload(ckpt.path, str(tmp_path / "durable"), keep=3)
    assert not (tmp_path / "durable").exists()


def test_context_checkpoint_is_a_snapshot_written_in_background(tmp_path):
    ctx = WorkContext.local({}, tmp_path / "out", checkpoint_dir=tmp_path / "ck")
    weights = torch.zeros(1000)
    ctx.checkpoint({"w": weights}, step=1)
    weights += 5  # training goes on and changes the tensor while the write may be in flight
    ctx.flush()
    state, step = ctx.restore()
    assert step == 1 and torch.equal(state["w"], torch.zeros(1000))
    with pytest.raises(CheckpointError, match=r"^state\['bad'\]\[1\]: a builtins.object is not"):
        ctx.checkpoint({"bad": [1, object()]}, step=2)
    assert [c.step for c in committed(tmp_path / "ck")] == [1]


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    import random

    import numpy as np

    ctx = WorkContext.local({}, tmp_path / "out", checkpoint_dir=tmp_path / "ck")
    ctx.checkpoint({"rng": ctx.rng_state()}, step=1, wait=True)
    expected = (random.random(), float(np.random.rand()), torch.rand(3).tolist())
    state, _ = ctx.restore()
    ctx.set_rng_state(state["rng"])
    assert (random.random(), float(np.random.rand()), torch.rand(3).tolist()) == expected


def test_restore_refuses_a_checkpoint_that_needs_arbitrary_classes(tmp_path):
    folder = tmp_path / "ck" / "step-1"
    folder.mkdir(parents=True)
    torch.save({"obj": Opaque()}, folder / STATE_FILE)  # written by something other than E31
    from e31.tasks.work.local_checkpoints import write_marker

    write_marker(folder, 1)
    ctx = WorkContext.local({}, tmp_path / "out", checkpoint_dir=tmp_path / "ck")
    with pytest.raises(CheckpointError) as err:
        ctx.restore()
    assert str(err.value).startswith(f"{folder / STATE_FILE}: Weights only load failed.")


def test_prune_keeps_the_newest_committed_and_never_touches_unmarked_folders(tmp_path):
    """keep=2 of committed steps 1, 4, 9: step-1 goes; step-2 (no marker:
    not a whole checkpoint E31 wrote) and other names stay."""
    from e31.tasks.checkpoint import prune

    for step in (1, 2, 4, 9):
        folder = tmp_path / f"step-{step}"
        folder.mkdir()
        (folder / "state.pt").write_bytes(b"x")
        if step != 2:
            (folder / "COMMITTED").write_text("{}")
    (tmp_path / "notes").mkdir()
    assert prune(str(tmp_path), 2) == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step-2", "step-4", "step-9"]
    assert prune(str(tmp_path), 2) == []


def test_a_conversion_finishing_between_the_two_looks_still_counts_as_written(tmp_path, monkeypatch):
    """The supervisor makes ``step-<N>/`` and only then removes the
    hand-over file; ``written`` must not see neither when that happens
    between its looks (the work's ``flush`` would raise 'not committed')."""
    from pathlib import Path

    from e31.tasks.work import local_checkpoints as lc

    folder = lc.write_state(tmp_path, {"w": torch.zeros(4)}, 3, handoff=True)
    raw = lc.handoff_path(folder)
    assert raw.is_file() and not folder.exists()
    real_is_dir, real_is_file = Path.is_dir, Path.is_file

    def convert_then(look):
        def patched(self):
            seen = look(self)
            if self in (folder, raw) and raw.exists():
                lc._convert_handoff(folder)  # the supervisor converts right after this look
            return seen
        return patched

    monkeypatch.setattr(Path, "is_dir", convert_then(real_is_dir))
    monkeypatch.setattr(Path, "is_file", convert_then(real_is_file))
    assert lc.written(folder)
    monkeypatch.undo()
    assert folder.is_dir() and not raw.exists()
