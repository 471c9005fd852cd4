"""Sharded checkpoints (``ctx.checkpoint_sharded``): two real ranks (``torch.distributed``, gloo on CPU,
two processes) save a ``DTensor`` sharded across them, each into its own folder as on two nodes; the parts
are uploaded, the lead seals the step only once every part of its own try is there, and the whole step
loads again on two ranks and on one (another sharding)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from e31.tasks import storage
from e31.tasks.checkpoint import fetch_sharded, latest_durable, prune, seal, upload
from e31.tasks.supervisor import uploader as uploader_module
from e31.tasks.supervisor.uploader import Uploader
from e31.tasks.work import sharded
from e31.tasks.work.context import WorkContext
from e31.tasks.work.local_checkpoints import MARKER, commit, latest_valid, missing_shards, verify
from e31.tasks.work.state import CheckpointError

WEIGHTS = torch.arange(8.0).reshape(4, 2)


def _rank(rank: int, port: int, root: str, step: int, token: str, load_from: str | None) -> None:
    """One rank (a ``torch.multiprocessing.spawn`` target): save ``WEIGHTS`` sharded by rows across the two
    ranks as the checkpoint of ``step`` under ``root/r<rank>``; or, with ``load_from``, load that whole
    folder and write what this rank got to ``root/got-<rank>.json``."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (2,))
        if load_from is None:
            state = {"w": distribute_tensor(WEIGHTS, mesh, [Shard(0)]), "step": step}
            folder = sharded.save(Path(root) / f"r{rank}", state, step, rank, 2, token)
            commit(folder)
        else:
            state = {"w": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]), "step": 0}
            sharded.load(Path(load_from), state)
            got = {"local": state["w"].to_local().tolist(), "step": state["step"]}
            (Path(root) / f"got-{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def _two_ranks(root: Path, step: int = 7, token: str = "try-1", load_from: Path | None = None) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(root), step, token, str(load_from) if load_from else None), nprocs=2)


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> Path:
    """Each rank's committed part of step 7 (``r0/step-7``, ``r1/step-7``), saved once for the module."""
    root = tmp_path_factory.mktemp("sharded")
    _two_ranks(root)
    return root


def _copy_parts(parts: Path, tmp_path: Path) -> tuple[Path, Path]:
    import shutil

    shutil.copytree(parts / "r0", tmp_path / "r0")
    shutil.copytree(parts / "r1", tmp_path / "r1")
    return tmp_path / "r0", tmp_path / "r1"


def test_each_rank_holds_only_its_part_which_is_never_taken_for_a_whole_checkpoint(parts: Path):
    lead, member = verify(parts / "r0" / "step-7"), verify(parts / "r1" / "step-7")
    assert sorted(lead["files"]) == [".metadata", "__0_0.distcp"] and sorted(member["files"]) == ["__1_0.distcp"]
    assert lead["sharded"] == {"rank": 0, "world_size": 2, "token": "try-1",
                               "shards": [".metadata", "__0_0.distcp", "__1_0.distcp"]}
    assert (missing_shards(lead), missing_shards(member)) == (["__1_0.distcp"], [".metadata", "__0_0.distcp"])
    assert latest_valid(parts / "r0") is None and latest_valid(parts / "r1") is None


def test_the_lead_seals_the_step_once_every_part_is_there_and_it_loads_on_two_ranks_and_on_one(parts, tmp_path):
    r0, r1 = _copy_parts(parts, tmp_path)
    durable = tmp_path / "durable"
    first = upload(r0 / "step-7", str(durable), keep=2, work_sha256="abc", run_id="run-1")
    assert (first.step, first.whole) == (7, False) and not (durable / "step-7" / MARKER).exists()
    member = upload(r1 / "step-7", str(durable), keep=2)
    assert (member.whole, (durable / "step-7" / MARKER).exists()) == (False, False)  # only the lead seals
    done = seal(str(durable), 7, keep=2, work_sha256="abc", run_id="run-1")
    assert (done.step, done.whole, done.work_sha256, done.run_id) == (7, True, "abc", "run-1")
    marker = json.loads((durable / "step-7" / MARKER).read_text())
    expected = {name: {"bytes": (r / "step-7" / name).stat().st_size, "sha256": storage.sha256_file(r / "step-7" / name)}
                for r, names in ((r0, [".metadata", "__0_0.distcp"]), (r1, ["__1_0.distcp"])) for name in names}
    assert marker["files"] == expected and done.bytes == sum(m["bytes"] for m in expected.values())
    assert latest_durable(str(durable)).step == 7

    fetched = tmp_path / "fetched"  # a resume: every rank fetches the whole step folder
    storage.get(str(durable / "step-7"), fetched / "step-7")
    assert latest_valid(fetched).step == 7
    _two_ranks(tmp_path, load_from=fetched / "step-7")
    got = [json.loads((tmp_path / f"got-{rank}.json").read_text()) for rank in (0, 1)]
    assert got == [{"local": WEIGHTS[:2].tolist(), "step": 7}, {"local": WEIGHTS[2:].tolist(), "step": 7}]
    whole = {"w": torch.zeros(4, 2), "step": 0}  # one process, no process group: the whole tensor
    sharded.load(fetched / "step-7", whole)
    assert torch.equal(whole["w"], WEIGHTS) and whole["step"] == 7


def test_a_part_of_another_try_never_seals_and_an_unsealed_step_is_pruned_once_a_later_one_is_whole(parts, tmp_path):
    r0, r1 = _copy_parts(parts, tmp_path)
    durable = tmp_path / "durable"
    upload(r1 / "step-7", str(durable), keep=2)
    note = durable / "step-7" / sharded.part_note_name(1)
    note.write_text(note.read_text().replace('"try-1"', '"try-0"'))  # a member of an earlier try, fenced off
    assert upload(r0 / "step-7", str(durable), keep=2).whole is False
    assert seal(str(durable), 7, keep=2) is None and not (durable / "step-7" / MARKER).exists()
    (durable / "step-9").mkdir()
    (durable / "step-9" / MARKER).write_text(json.dumps({"step": 9, "files": {}}))
    (durable / "step-3").mkdir()  # not E31's: left alone
    assert prune(str(durable), keep=2) == [7]
    assert sorted(p.name for p in durable.iterdir()) == ["step-3", "step-9"]


def test_the_leads_uploader_makes_the_step_durable_when_the_last_part_lands(parts, tmp_path, monkeypatch):
    r0, r1 = _copy_parts(parts, tmp_path)
    durable = tmp_path / "durable"
    lead = Uploader(r0, str(durable), keep=2, work_sha256="abc", run_id="run-1", api_alive=lambda: False)
    lead.poll()
    monkeypatch.setattr(uploader_module, "SEAL_WAIT_S", 1.0)
    assert lead.finish(inline=True) is None  # rank 1's part never came
    assert lead.failures == ["sharded checkpoint of step 7: not every rank's part reached the checkpoint URL "
                             "within 1 s; it does not count (the newest whole one does)"]
    member = Uploader(r1, str(durable), keep=2, api_alive=lambda: False, seals=False)
    assert member.finish(inline=True) is None and member.failures == []
    again = Uploader(r0, str(durable), keep=2, work_sha256="abc", run_id="run-1", api_alive=lambda: False)
    done = again.finish(inline=True)
    assert (done.step, done.whole, again.failures) == (7, True, [])


def test_a_try_of_the_lead_fetches_the_newest_whole_step_over_its_own_part(parts, tmp_path):
    r0, r1 = _copy_parts(parts, tmp_path)
    durable = tmp_path / "durable"
    upload(r1 / "step-7", str(durable), keep=2)
    upload(r0 / "step-7", str(durable), keep=2, work_sha256="abc")  # sealed: both parts are there
    assert fetch_sharded(r0, str(durable), "abc") == 7
    assert latest_valid(r0).step == 7 and sorted(verify(r0 / "step-7")["files"]) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert fetch_sharded(r0, str(durable), "abc") is None  # whole here now: nothing to fetch


def test_restore_sharded_refuses_a_checkpoint_saved_whole(tmp_path):
    ctx = WorkContext.local({}, tmp_path / "out", checkpoint_dir=tmp_path / "ckpt")
    ctx.checkpoint({"w": torch.ones(2)}, step=4)
    with pytest.raises(CheckpointError) as err:
        ctx.restore_sharded({"w": torch.zeros(2)})
    assert str(err.value) == ("checkpoint step-4 was not saved with ctx.checkpoint_sharded (no .metadata): "
                              "restore it with ctx.restore()")
    assert WorkContext.local({}, tmp_path / "o2", checkpoint_dir=tmp_path / "c2").restore_sharded({}) is None


def test_a_single_process_saves_and_restores_a_whole_sharded_checkpoint(tmp_path):
    ctx = WorkContext.local({}, tmp_path / "out", checkpoint_dir=tmp_path / "ckpt")
    ctx.checkpoint_sharded({"w": WEIGHTS, "step": 3}, step=3)
    marker = verify(tmp_path / "ckpt" / "step-3")
    assert sorted(marker["files"]) == [".metadata", "__0_0.distcp"] and missing_shards(marker) == []
    state = {"w": torch.zeros(4, 2), "step": 0}
    assert ctx.restore_sharded(state) == 3 and torch.equal(state["w"], WEIGHTS) and state["step"] == 3


def test_a_newest_durable_checkpoint_that_does_not_verify_is_skipped_for_the_older_whole_one(tmp_path):
    """A resume takes the newest durable checkpoint whose files verify once fetched: a byte changed in the
    newest one at the store makes it take the step before, and say why (it never starts fresh while a
    whole checkpoint of the work is there)."""
    from e31.tasks.checkpoint import fetch_newest
    from e31.tasks.work.local_checkpoints import save_state

    durable = tmp_path / "durable"
    for step in (10, 18):
        save_state(tmp_path / "work", {"w": torch.full((4,), float(step))}, step)
        upload(tmp_path / "work" / f"step-{step}", str(durable), keep=3, work_sha256="abc")
    blob = bytearray((durable / "step-18" / "state.pt").read_bytes())
    blob[-5] ^= 0xFF
    (durable / "step-18" / "state.pt").write_bytes(bytes(blob))
    rejected: list[str] = []
    local = tmp_path / "resumed"
    assert fetch_newest(local, str(durable), "abc", rejected=rejected) == 10
    assert rejected == [f"the checkpoint of step 18 at {durable}/step-18 does not verify (a file's size or "
                        "sha256 differs from its marker): skipped"]
    assert [c.step for c in [latest_valid(local)]] == [10] and not (local / "step-18").exists()
    assert fetch_newest(local, str(durable), "abc", above=10) is None  # nothing newer that verifies
    assert fetch_newest(local, str(durable), "other work") is None


def test_a_failed_sharded_save_is_a_checkpoint_error_naming_the_rank_and_the_cause(tmp_path):
    """torch's ``CheckpointException`` derives from ``BaseException``: a work's ``except Exception`` would
    not catch it.  It is raised as ``CheckpointError`` with each failed rank's cause in one line."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step-2").symlink_to(tmp_path / "nowhere")  # DCP's own folder cannot be made
    ctx = WorkContext.local({}, tmp_path / "out", checkpoint_dir=tmp_path / "ckpt")
    with pytest.raises(CheckpointError) as err:
        ctx.checkpoint_sharded({"w": WEIGHTS}, step=2)
    assert str(err.value) == ("sharded checkpoint of step 2 could not be saved: rank 0: FileExistsError: [Errno 17] "
                              f"File exists: '{tmp_path}/ckpt/step-2'")
