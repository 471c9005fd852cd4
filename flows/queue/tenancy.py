"""Which tenant a job is submitted for, and how a flow run carries it (the tag ``tenant:NAME``).

The tenants are the pool file's (:mod:`e31.specs.tenants`).  A submission names one with ``--tenant``;
without it, the tenant whose ``members`` include the submitting OS user, else ``default``.  The tag is
written when the flow run is created (``e31 submit``) or on the deployment its runs are created from
(``e31 deploy`` onto a pool file), and nothing changes it afterwards.
"""

from __future__ import annotations

from typing import Any

from e31.errors import InvalidInput
from e31.specs.pool import PoolSpec
from e31.specs.tenants import DEFAULT_TENANT

__all__ = ["TENANT_TAG", "TenantError", "borrowing_ids", "choose_tenant", "tenant_of"]

#: A flow run's tenant: ``tenant:`` and its name.
TENANT_TAG = "tenant:"


class TenantError(InvalidInput):
    """``--tenant`` names no tenant of the pool: one line naming the pool's tenants."""


def choose_tenant(pool: PoolSpec, named: str | None, user: str) -> str:
    """The tenant a submission is for: ``named`` (``--tenant``) when given, else the tenant whose
    ``members`` include ``user`` (the submitting OS user), else ``default``.  Raises
    :class:`TenantError` when ``named`` is not a tenant of ``pool``."""
    if named is None:
        return pool.tenant_of(user)
    if pool.tenant(named) is None:
        raise TenantError(f"--tenant: pool {pool.name} has no tenant {named!r}; name one of "
                          f"{', '.join(pool.tenant_names())}, or add it to the pool file's tenants")
    return named


def tenant_of(tags: Any) -> str:
    """The tenant a flow run's ``tags`` name (:data:`TENANT_TAG`), else ``default`` (a run submitted
    before the pool declared tenants)."""
    for tag in tags or ():
        if isinstance(tag, str) and tag.startswith(TENANT_TAG) and len(tag) > len(TENANT_TAG):
            return tag[len(TENANT_TAG):]
    return DEFAULT_TENANT


def borrowing_ids(snap: Any, placements: list[Any]) -> set[str]:
    """The ids of the snapshot's queued runs that borrow beyond their tenant's quota, in the order of the
    plan ``placements`` (:func:`e31.flows.placement.tenants.fair_order`); none without tenants."""
    from e31.flows.placement.tenants import fair_order

    if snap.tenancy is None:
        return set()
    by_id = {job.id: job for job in snap.queued}
    ordered = [by_id[p.job] for p in placements if p.job in by_id and p.action != "refuse"]
    _, nominal = fair_order(ordered, snap.running, snap.tenancy)
    return {job.id for job in ordered} - nominal
