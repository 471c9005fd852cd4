"""A work that uses ``torch.distributed`` runs under E31 as written for ``torchrun``: its
``init_process_group`` finds the rendezvous in the environment (a single-node job is a world of one)."""

from __future__ import annotations

import json
import textwrap

WORK = textwrap.dedent("""
    import json, os
    import torch
    import torch.distributed as dist

    def main(ctx):
        dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
        t = torch.tensor([float(ctx.rank + 5)])
        dist.all_reduce(t)
        seen = {"rank": ctx.rank, "world_size": ctx.world_size, "is_lead": ctx.is_lead,
                "dist": [dist.get_rank(), dist.get_world_size()], "sum": t.item(),
                "env": {k: os.environ[k] for k in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NNODES",
                                                   "E31_NODE_RANK", "E31_NNODES")}}
        dist.destroy_process_group()
        (ctx.output_dir / "seen.json").write_text(json.dumps(seen, sort_keys=True))
""")


def test_a_work_meets_its_ranks_with_init_process_group_and_no_arguments(e31, tmp_path, prefect_api, scratch):
    (tmp_path / "distwork.py").write_text(WORK)
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps({"name": "dist-one", "work": {"kind": "training", "entrypoint": "distwork:main"},
                                "request": {"cpus": 1, "limit": "5m"},
                                "output": {"kind": "files", "url": str(tmp_path / "out"), "files": ["seen.json"]}}))
    result = e31("run", str(spec))
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "out" / "seen.json").read_text()) == {
        "rank": 0, "world_size": 1, "is_lead": True, "dist": [0, 1], "sum": 5.0,
        "env": {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "NNODES": "1",
                "E31_NODE_RANK": "0", "E31_NNODES": "1"}}
