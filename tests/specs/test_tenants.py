"""Tenants in the pool file: defaults, lookups, and every problem at once with its field path."""

from __future__ import annotations

from datetime import timedelta

import pytest

from e31.specs import SpecError, load_pool
from e31.specs.tenants import DEFAULT_TENANT

GIB = 1024**3
NODES = "pool_version: 1\nname: lab\nnodes:\n  - {name: gpu, count: 2, gpus: 8, cpus: 64, memory: 512GiB}\n"


def _pool(tmp_path, text: str):
    path = tmp_path / "pool.yaml"
    path.write_text(NODES + text, encoding="utf-8")
    return load_pool(path)


def test_tenants_with_their_defaults_and_who_belongs_where(tmp_path):
    pool = _pool(tmp_path, (
        "tenants:\n"
        "  - {name: vision, quota: {gpus: 8, cpus: 32, memory: 256GiB}, weight: 2, members: [alice, bob]}\n"
        "  - {name: nlp, quota: {gpus: 4}, borrow_limit: {gpus: 2}}\n"
        "fair_share: {half_life: 3d}\n"))
    vision, nlp = pool.tenants
    assert vision.quota.as_tuple() == (8, 32, 256 * GIB) and vision.weight == 2.0 and vision.borrow_limit is None
    assert nlp.quota.as_tuple() == (4.0, float("inf"), float("inf")) and nlp.weight == 1.0 and nlp.borrow_limit.as_tuple() == (2.0, float("inf"), float("inf"))
    assert pool.fair_share.half_life == timedelta(days=3)
    assert (pool.tenant_of("bob"), pool.tenant_of("carol")) == ("vision", DEFAULT_TENANT)
    assert pool.tenant_names() == ["vision", "nlp", "default"]
    assert pool.tenant("default").quota.as_tuple() == (0, 0, 0) and pool.tenant("nobody") is None


def test_a_pool_without_tenants_has_only_the_default_one(tmp_path):
    pool = _pool(tmp_path, "")
    assert pool.tenants == [] and pool.tenant_names() == ["default"] and pool.tenant_of("alice") == "default"
    assert pool.fair_share.half_life == timedelta(days=7)  # Slurm's PriorityDecayHalfLife default


def test_every_tenant_problem_at_once_with_its_field_path(tmp_path):
    with pytest.raises(SpecError) as caught:
        _pool(tmp_path, (
            "tenants:\n"
            "  - {name: vision, quota: {gpus: 12, cpus: 200}, weight: 0, members: [alice, bob], colour: red}\n"
            "  - {name: nlp, quota: {gpus: 8, memory: lots}, members: [alice]}\n"
            "  - {name: vision, borrow_limit: {gpus: -1}}\n"
            "fair_share: {half_life: 0s}\n"))
    assert [f"{p.path}: {p.message}" for p in caught.value.problems] == [
        "tenants: the tenants' quotas of gpus add up to more than the pool's 16 (got 20); lower the quotas: a quota "
        "is a guarantee, and the pool must hold all of them at once",
        "tenants[0].weight: must be > 0.0 (got 0)",
        "tenants[0].quota.cpus: is more than the pool has (128) (got 200); lower it, or add nodes",
        "tenants[1].quota.memory: must be a memory size such as 512MB, 1.5GB, 4GiB or a number of bytes (got 'lots')",
        "tenants[1].members[0]: user 'alice' is also a member of tenant 'vision' (tenants[0]) (got 'alice'); list each "
        "user in one tenant (a job names another with --tenant)",
        "tenants[2].borrow_limit.gpus: must be >= 0 (got -1)",
        "tenants[2].name: tenant 'vision' is also declared by tenants[0] (got 'vision'); give each tenant its own name",
        "fair_share.half_life: must be longer than 0 seconds (got '0s')",
        "tenants[0].colour: unknown field; allowed fields: name, quota, weight, borrow_limit, members",
    ]


def test_a_borrow_limit_on_what_the_quota_does_not_name_a_user_listed_twice_and_loose_values_are_refused(tmp_path):
    """A borrow_limit bounds only what the quota names: one on another resource was accepted and did nothing.
    A weight given as a string or a boolean was read as a number (true as 1.0)."""
    with pytest.raises(SpecError) as caught:
        _pool(tmp_path, (
            "tenants:\n"
            "  - {name: vision, quota: {gpus: 2}, borrow_limit: {cpus: 1}, members: [alice, alice], weight: '2'}\n"
            "  - {name: 'Team B:x', weight: .nan}\n"
            "  - {name: nlp, weight: true, members: [bob smith]}\n"
            "  - {name: ops, quota: {}, borrow_limit: {cpus: 1}}\n"))  # no quota: the limit bounds all it borrows
    assert [f"{p.path}: {p.message}" for p in caught.value.problems] == [
        "tenants[0].weight: input should be a valid number (got '2')",
        "tenants[0].members[1]: user 'alice' is listed twice in this tenant (got 'alice'); list each user once",
        "tenants[0].borrow_limit.cpus: bounds nothing: a borrow_limit bounds only what the quota names, and this "
        "tenant's quota names no cpus (got 1); add cpus to its quota (0 for none guaranteed), or leave it out here",
        "tenants[1].name: must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit (got "
        "'Team B:x'); it names the tenant in --tenant and its runs' tags, e.g. vision",
        "tenants[1].weight: input should be a finite number (got nan)",
        "tenants[2].weight: input should be a valid number (got True)",
        "tenants[2].members[0]: must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit "
        "(got 'bob smith'); give the OS user name of a submitter, e.g. alice",
    ]
