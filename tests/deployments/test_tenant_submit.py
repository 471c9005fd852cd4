"""A submission carries its tenant: ``--tenant``, else the submitter's membership, else ``default``;
an unknown tenant is refused at once, before anything is created (real server)."""

from __future__ import annotations

import getpass
import json
import sys
import uuid

from prefect.client.orchestration import get_client


def _files(tmp_path, members: list[str]):
    tag = uuid.uuid4().hex[:8]
    pool, spec = tmp_path / "pool.yaml", tmp_path / "job.yaml"
    pool.write_text(json.dumps({"name": f"ten-{tag}", "nodes": [{"name": "n1", "gpus": 2, "cpus": 4, "memory": "8GiB"}],
                                "tenants": [{"name": "vision", "quota": {"gpus": 1}, "members": members},
                                            {"name": "nlp", "quota": {"gpus": 1}}]}))
    spec.write_text(json.dumps({"name": f"job-{tag}", "work": {"kind": "simulation", "command": [sys.executable, "-c", ""]},
                                "request": {"cpus": 1, "duration": "5s", "limit": "1m"},
                                "output": {"kind": "results", "url": str(tmp_path / "out"), "files": ["r.json"]}}))
    return pool, spec


def _tags(said) -> list[str]:
    run = said.stdout.split("flow run ")[1].split()[0]
    with get_client(sync_client=True) as client:
        return [t for t in client.read_flow_run(run).tags if t.startswith("tenant:")]


def test_a_submission_is_for_the_named_tenant_else_the_submitter_s_else_default(prefect_api, tmp_path, e31):
    pool, spec = _files(tmp_path, members=[getpass.getuser()])
    mine = e31("submit", str(spec), "--pool", str(pool))
    assert mine.returncode == 0, mine.stderr
    assert mine.stdout.startswith(f"submitted {json.loads(spec.read_text())['name']} for tenant vision: flow run ")
    assert _tags(mine) == ["tenant:vision"]
    named = e31("submit", str(spec), "--pool", str(pool), "--tenant", "nlp")
    assert named.returncode == 0, named.stderr
    assert _tags(named) == ["tenant:nlp"]
    pool, spec = _files(tmp_path, members=["somebody-else"])
    anyone = e31("submit", str(spec), "--pool", str(pool))
    assert anyone.returncode == 0, anyone.stderr
    assert _tags(anyone) == ["tenant:default"]


def test_an_unknown_tenant_is_refused_in_one_line_before_anything_is_created(prefect_api, tmp_path, e31):
    pool, spec = _files(tmp_path, members=[])
    name = json.loads(pool.read_text())["name"]
    refused = e31("submit", str(spec), "--pool", str(pool), "--tenant", "robotics")
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr == (f"e31: --tenant: pool {name} has no tenant 'robotics'; name one of vision, nlp, default, "
                              "or add it to the pool file's tenants\n")
    with get_client(sync_client=True) as client:
        from prefect.exceptions import ObjectNotFound

        try:
            client.read_work_pool(name)  # the pool's work pool: e31 submit creates it first
            created = True
        except ObjectNotFound:
            created = False
    assert not created
    deploy = e31("deploy", str(spec), "--pool", "some-process-pool", "--tenant", "vision")
    assert deploy.returncode == 2
    assert deploy.stderr == ("e31: deploy refused: --tenant needs an E31 pool file as --pool (got the work pool "
                             "'some-process-pool'): tenants are declared in a pool file\n")
