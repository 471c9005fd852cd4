"""The pool declaration: loading, count expansion, exact error messages, schema."""

from __future__ import annotations

import pytest

from e31.specs import NodeSpec, PoolSpec, SpecError, load_pool, parse_spec, pool_json_schema

GIB = 1024**3


def write(tmp_path, text: str, name: str = "pool.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_count_expands_to_numbered_nodes(tmp_path):
    pool = load_pool(write(tmp_path, (
        "pool_version: 1\nname: lab\nnodes:\n"
        "  - {name: a100, count: 3, gpus: 8, gpu_type: A100, cpus: 64, memory: 512GiB}\n"
        "  - {name: big, cpus: 192, memory: 1.5TiB}\n"
    )))
    assert pool.name == "lab"
    assert [name for name, _ in pool.node_lines()] == ["a100-1", "a100-2", "a100-3", "big"]
    line = pool.nodes[0]
    assert (line.gpus, line.gpu_type, line.cpus, line.memory) == (8, "A100", 64, 512 * GIB)
    assert pool.nodes[1].gpus == 0 and pool.nodes[1].memory == int(1.5 * 1024 * GIB)
    assert NodeSpec(name="x", cpus=1, memory=1).names() == ["x"]


def test_json_pool_and_defaults(tmp_path):
    pool = load_pool(write(tmp_path, '{"nodes": [{"name": "n", "cpus": 2, "memory": 1024}]}', "pool.json"))
    assert pool == PoolSpec(pool_version=1, name="pool", nodes=[NodeSpec(name="n", count=1, gpus=0, cpus=2, memory=1024)])


@pytest.mark.parametrize(("text", "problems"), [
    ("nodes: []\n", ["nodes: must have at least 1 item(s) (got [])"]),
    ("name: lab\n", ["nodes: required field is missing; add e.g. nodes: [{name: gpu, count: 4, gpus: 8, cpus: 64, memory: 512GiB}]"]),
    ("- a\n", ["(pool): the document must be a mapping of pool_version, name, nodes (got ['a'])"]),
    ("pool_version: 2\nnodes: [{name: n, cpus: 1, memory: 1GiB}]\n", ["pool_version: must be 1 (got 2)"]),
    ("nodes:\n  - {name: a, count: 2, gpus: -1, gpu_typ: A100, cpus: 0, memory: lots}\n"
     "  - {name: a-2, cpus: 4, memory: 1GiB}\n"
     "  - {name: c, gpu_type: H100, cpus: 4}\n", [
        "nodes[0].gpus: must be >= 0 (got -1)",
        "nodes[0].cpus: must be >= 1 (got 0)",
        "nodes[0].memory: must be a memory size such as 512MB, 1.5GB, 4GiB or a number of bytes (got 'lots')",
        "nodes[1].name: node name 'a-2' is also declared by nodes[0] (got 'a-2'); give each node line its own "
        "name (count: N names them NAME-1..NAME-N)",
        "nodes[2].gpu_type: names a GPU model for a node without GPUs (got 'H100'); add gpus: N or remove gpu_type",
        "nodes[2].memory: required field is missing; add e.g. memory: 512GiB",
        "nodes[0].gpu_typ: unknown field; did you mean 'gpu_type'?",
    ]),
    ("nodes: [{name: n, count: 0, cpus: 1, memory: 1GiB, colour: red}]\n", [
        "nodes[0].count: must be >= 1 (got 0)",
        "nodes[0].colour: unknown field; allowed fields: name, count, gpus, gpu_type, cpus, memory, group, scratch_budget",
    ]),
    ("nodes: [{name: n, cpus: 1, memory: 1GiB, scratch_budget: lots}, {name: m, cpus: 1, memory: 1GiB, "
     "scratch_budget: 0}]\n", [
        "nodes[0].scratch_budget: must be a memory size such as 512MB, 1.5GB, 4GiB or a number of bytes (got 'lots')",
        "nodes[1].scratch_budget: must be more than 0 bytes (got 0)",
    ]),
    ("nodes: [{name: n, count: 60000, cpus: 1, memory: 1GiB}, {name: m, count: 60000, cpus: 1, memory: 1GiB}]\n", [
        "nodes: must declare at most 100,000 nodes (got 120,000 with counts expanded)",
    ]),
    ("nodes: [{name: n, cpus: 1, memory: 1GiB}]\nnodes: []\n", [
        "nodes: duplicate key (got it twice, at lines 1 and 2); keep one",
        "nodes: must have at least 1 item(s) (got [])",
    ]),
    ("nodes: [{name: 'a b', cpus: 1, memory: 1GiB, gpus: 1, gpu_type: 'H 100'}]\n", [
        "nodes[0].name: must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit "
        "(got 'a b'); e.g. gpu or a100 (count: N names the nodes a100-1..a100-N)",
        "nodes[0].gpu_type: must be 1 to 63 letters, digits, '.', '_' or '-', e.g. H100 (got 'H 100'); name a GPU model",
    ]),
])
def test_invalid_pools_list_every_problem(tmp_path, text, problems):
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_pool(path)
    noun = "problem" if len(problems) == 1 else "problems"
    assert str(info.value) == f"invalid pool {path} ({len(problems)} {noun})\n" + "\n".join(f"  {p}" for p in problems)
    assert info.value.exit_code == 2


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(SpecError) as info:
        load_pool(tmp_path / "missing.yaml")
    assert str(info.value) == (f"invalid pool {tmp_path / 'missing.yaml'} (1 problem)\n"
                               f"  (pool): file not found (got '{tmp_path / 'missing.yaml'}'); check the path")
    path = write(tmp_path, "nodes: [\n")
    with pytest.raises(SpecError) as info:
        load_pool(path)
    assert str(info.value).startswith(f"invalid pool {path} (1 problem)\n  {path}:2:1: YAML syntax error")


def test_schema_describes_every_field():
    schema = pool_json_schema()
    assert schema["title"] == "E31 pool"
    node = schema["$defs"]["NodeSpec"]["properties"]
    assert list(node) == ["name", "count", "gpus", "gpu_type", "cpus", "memory", "group", "scratch_budget"]
    assert all(prop.get("description") for prop in [*schema["properties"].values(), *node.values()])
    assert schema["$defs"]["NodeSpec"]["required"] == ["name", "cpus", "memory"]


def test_request_gpu_type_is_optional():
    base = "name: j\nwork: {kind: training, entrypoint: m:f}\noutput: {kind: model, url: /o/, files: [m.pt]}\n"
    assert parse_spec(base + "request: {gpus: 1, limit: 1h}").request.gpu_type is None
    assert parse_spec(base + "request: {gpus: 1, gpu_type: H100, limit: 1h}").request.gpu_type == "H100"
    with pytest.raises(SpecError) as info:
        parse_spec(base + "request: {gpus: 1, gpu_type: 'H100/80', limit: 1h}")
    assert info.value.problems[0].message == (
        "must be 1 to 63 letters, digits, '.', '_' or '-', e.g. H100 (got 'H100/80'); name a GPU model")
