"""The raw hand-over of a checkpoint's state from the work to the supervisor
(tasks.handoff): what the supervisor commits loads back exactly as a
``torch.save`` of the same state would; states it would not keep exactly are
saved with ``torch.save`` at once; a conversion interrupted at any step is
redone; a hand-over file that is torn or names arbitrary code is never
committed."""

from __future__ import annotations

import collections
import io
import json
import os
import pickle

import pytest
import torch
from torch import nn

from e31.tasks.work import handoff
from e31.tasks.work.local_checkpoints import (MARKER, PENDING, STATE_FILE, CheckpointError, commit, commit_pending, discard_torn,
                               handoff_path, latest_valid, load_state, write_state)


def _training_state() -> dict:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0])).backward()
    opt.step()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    return {
        "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
        "rng": torch.get_rng_state(), "epoch": 3,
        "misc": collections.OrderedDict(
            dtype=torch.bfloat16, device=torch.device("cpu"), size=torch.Size([2, 3]), tags={"a", "b"}, c=1 + 2j,
            raw=b"\x00\x01", none=None, nested=[(1, 2.5), {"k": torch.arange(6, dtype=torch.int16).reshape(2, 3)}],
            empty=torch.empty(0, 4), half=torch.ones(3, dtype=torch.bfloat16), flags=torch.tensor([True, False]),
            scalar=torch.tensor(7.5, requires_grad=True), cplx=torch.tensor([1 + 1j], dtype=torch.complex64)),
    }


def _same(a, b, path="state"):
    """Equal values, types, dtypes, shapes, strides and requires_grad, and
    the state_dict metadata."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor) and a.layout != torch.strided:
        assert (a.layout, a.dtype, a.shape) == (b.layout, b.dtype, b.shape), path
        assert torch.equal(a.to_dense(), b.to_dense()), path
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.requires_grad) == (b.dtype, b.shape, b.stride(), b.requires_grad), path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def _torch_round_trip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_committed_hand_over_loads_exactly_as_torch_save(tmp_path):
    state = _training_state()
    folder = write_state(tmp_path, state, 4, handoff=True)
    assert folder == tmp_path / "step-4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4.handoff"]  # one file, renamed in when whole
    assert commit_pending(tmp_path) == [4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]
    assert sorted(p.name for p in folder.iterdir()) == [MARKER, PENDING, STATE_FILE]
    assert list(json.loads((folder / MARKER).read_text())["files"]) == [STATE_FILE]
    assert latest_valid(tmp_path).step == 4
    _same(load_state(folder / STATE_FILE), _torch_round_trip(state))


def test_newest_only_converts_the_newest_hand_over_and_drops_the_rest(tmp_path):
    for step in (1, 2, 3):
        write_state(tmp_path, {"w": torch.full((10,), float(step))}, step, handoff=True)
    assert commit_pending(tmp_path, newest_only=True) == [3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]
    assert torch.equal(load_state(tmp_path / "step-3" / STATE_FILE)["w"], torch.full((10,), 3.0))


@pytest.mark.parametrize("case", ["view", "shared", "parameter", "sparse"])
def test_states_the_raw_form_would_change_are_saved_with_torch_save(tmp_path, case):
    base = torch.arange(10.0)
    state = {"view": {"v": base[2:5]}, "shared": {"a": base, "b": base},
             "parameter": {"p": nn.Parameter(torch.ones(2))},
             "sparse": {"s": torch.eye(3).to_sparse()}}[case]
    folder = write_state(tmp_path, state, 1, handoff=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    assert sorted(p.name for p in folder.iterdir()) == [PENDING, STATE_FILE]
    commit(folder)
    _same(load_state(folder / STATE_FILE), _torch_round_trip(state))


def test_interrupted_conversion_is_redone_at_each_step(tmp_path):
    """The supervisor killed between the steps of a conversion: the next
    commit finishes it and the checkpoint equals the state."""
    state = {"w": torch.arange(100, dtype=torch.float64), "step": 9}
    expected = _torch_round_trip(state)
    # 1. killed while writing the temporary state.pt (the folder has no note yet)
    folder = write_state(tmp_path / "a", state, 9, handoff=True)
    folder.mkdir()
    (folder / f".{STATE_FILE}.part").write_bytes(b"half a zip")
    # 2. killed after the note was written, before the hand-over file was removed
    folder = write_state(tmp_path / "b", state, 9, handoff=True)
    folder.mkdir()
    torch.save(state, folder / STATE_FILE)
    (folder / PENDING).write_text(json.dumps({"step": 9, "files": {STATE_FILE: {
        "bytes": (folder / STATE_FILE).stat().st_size}}}))
    for name in "ab":
        assert commit_pending(tmp_path / name) == [9]
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["step-9"]
        ckpt = latest_valid(tmp_path / name)
        assert ckpt.step == 9
        assert sorted(p.name for p in ckpt.path.iterdir()) == [MARKER, PENDING, STATE_FILE]
        _same(load_state(ckpt.path / STATE_FILE), expected)


def test_torn_or_hostile_hand_over_is_never_committed(tmp_path):
    """A hand-over being written (its temporary name) is removed at the next
    start; one that is cut short, or whose skeleton names code to run, is
    removed without being committed or unpickled."""
    state = {"w": torch.ones(1000)}
    write_state(tmp_path / "torn", state, 1, handoff=True)
    raw = handoff_path(tmp_path / "torn" / "step-1")
    body = raw.read_bytes()
    raw.write_bytes(body[:-100])
    (tmp_path / "torn" / ".step-2.handoff.1a2b3c4d.part").write_bytes(body[:50])
    assert commit_pending(tmp_path / "torn") == []
    assert discard_torn(tmp_path / "torn") == [".step-2.handoff.1a2b3c4d.part"]
    assert list((tmp_path / "torn").iterdir()) == []

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    hostile = tmp_path / "hostile"
    hostile.mkdir()
    header = pickle.dumps({"skeleton": pickle.dumps(Boom()), "tensors": []})
    (hostile / "step-2.handoff").write_bytes(handoff.MAGIC + len(header).to_bytes(8, "little") + header)
    with pytest.raises(pickle.UnpicklingError, match=r"^posix\.system is not allowed in a checkpoint state$"):
        handoff.read(hostile / "step-2.handoff")
    assert commit_pending(hostile) == []
    assert list(hostile.iterdir()) == [] and not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("handoff_on", [True, False])
def test_refused_state_names_the_entry_and_writes_nothing(tmp_path, handoff_on):
    for bad, where in (({"x": object()}, r"state\['x'\]: a builtins.object"),
                       ({"ok": torch.ones(2), "deep": [1, {"n": frozenset({1})}]}, r"state\['deep'\]\[1\]\['n'\]: a "
                                                                                 r"builtins.frozenset")):
        with pytest.raises(CheckpointError, match=rf"^{where} is not a tensor or plain value"):
            write_state(tmp_path, bad, 1, handoff=handoff_on)
    assert list(tmp_path.iterdir()) == []
