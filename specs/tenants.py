"""Tenants of a pool: the teams that share it, each with a quota, a weight and a borrow limit.

    tenants:
      - name: vision
        quota: {gpus: 16, cpus: 128, memory: 1TiB}   # guaranteed to it (nominal quota)
        weight: 2                                    # its fair share, relative to the others'
        borrow_limit: {gpus: 8}                      # beyond its quota it may use (a resource left out: any)
        members: [alice, bob]                        # OS user names whose jobs are its by default
      - name: nlp
        quota: {gpus: 8}
    fair_share: {half_life: 7d}

A quota is what a tenant is guaranteed: its jobs within it are admitted before any tenant's borrowing,
and capacity lent to others beyond their quotas is taken back for it by preemption (Kueue's ClusterQueue
``nominalQuota``, ``borrowingLimit`` and reclaim within a cohort play the same parts).  Among tenants,
the queue orders by fair share: each tenant's dominant resource share of its usage decayed with
``fair_share.half_life`` (Slurm's ``PriorityDecayHalfLife``, default 7 days), over its weight.  A job of
a user who is no tenant's member, submitted without ``--tenant``, is tenant ``default``'s: declared or
not (undeclared, it has no quota and a weight of 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from typing import Annotated

from pydantic import AfterValidator, Field, StrictInt, WithJsonSchema

from .base import RuleError, SpecModel, spec_error
from .errors import short_repr
from .fields import SAFE_NAME, valid_job_name
from .quantities import Duration, Memory

__all__ = ["DEFAULT_TENANT", "BorrowLimit", "FairShare", "Resources", "TenantSpec", "tenant_rules"]

#: The tenant of a job whose submitter is no tenant's member and who named none.
DEFAULT_TENANT = "default"


def _name_check(what: str, example: str):
    def check(value: str) -> str:
        if not valid_job_name(value):
            raise spec_error("must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit",
                             fix=f"{what}, e.g. {example}")
        return value
    return check


#: A tenant's name (what ``--tenant`` names and the ``tenant:NAME`` tag carries).
TenantName = Annotated[str, AfterValidator(_name_check("it names the tenant in --tenant and its runs' tags", "vision")),
                       WithJsonSchema({"type": "string", "pattern": SAFE_NAME, "minLength": 1, "maxLength": 63})]
#: An OS user name, as a tenant's member.
UserName = Annotated[str, AfterValidator(_name_check("give the OS user name of a submitter", "alice")),
                     WithJsonSchema({"type": "string", "pattern": SAFE_NAME, "minLength": 1, "maxLength": 63})]


class Resources(SpecModel):
    """A tenant's quota: ``gpus`` (whole devices), ``cpus`` (cores), ``memory`` (BYTES; ``1TiB`` etc.
    accepted).  A resource left out is not part of the quota: a job's use of it never makes the job
    borrow (``quota: {gpus: 8}`` guarantees 8 GPUs, with whatever CPUs and memory those jobs ask for).
    A quota that names nothing guarantees nothing.  Raises (on validation)
    :class:`e31.specs.errors.SpecError`: a negative count, an unreadable size."""

    gpus: StrictInt | None = Field(None, ge=0, le=10_000_000, description="GPU devices.")
    cpus: StrictInt | None = Field(None, ge=0, le=100_000_000, description="CPU cores.")
    memory: Memory | None = Field(None, description="Memory in bytes, or a size such as 1TiB.")

    def as_tuple(self) -> tuple[float, float, float]:
        """``(gpus, cpus, memory bytes)``: ``inf`` for a resource left out, all 0 when none is named."""
        values = (self.gpus, self.cpus, self.memory)
        if all(v is None for v in values):
            return 0.0, 0.0, 0.0
        return tuple(float("inf") if v is None else float(v) for v in values)  # type: ignore[return-value]


class BorrowLimit(SpecModel):
    """How much beyond its quota a tenant may hold: ``gpus``, ``cpus``, ``memory`` (BYTES); a field left
    out is no limit on that resource (Kueue's ``borrowingLimit`` reads so).  Raises (on validation)
    :class:`e31.specs.errors.SpecError`: a negative count, an unreadable size."""

    gpus: StrictInt | None = Field(None, ge=0, le=10_000_000, description="GPU devices (left out: no limit).")
    cpus: StrictInt | None = Field(None, ge=0, le=100_000_000, description="CPU cores (left out: no limit).")
    memory: Memory | None = Field(None, description="Memory in bytes, or a size such as 1TiB (left out: no limit).")

    def as_tuple(self) -> tuple[float, float, float]:
        """``(gpus, cpus, memory bytes)``, ``inf`` for a resource without a limit."""
        inf = float("inf")
        return (inf if self.gpus is None else float(self.gpus), inf if self.cpus is None else float(self.cpus),
                inf if self.memory is None else float(self.memory))


class FairShare(SpecModel):
    """How the queue weighs tenants' past usage: ``half_life`` (a duration, default 7 days), after which
    a GPU-hour used counts half as much (Slurm's ``PriorityDecayHalfLife``)."""

    half_life: Duration = Field(timedelta(days=7), description=(
        "Past usage counts half as much after this long, e.g. 7d (Slurm's PriorityDecayHalfLife)."))


class TenantSpec(SpecModel):
    """One tenant of a pool (see the module docstring).  Raises (on validation)
    :class:`e31.specs.errors.SpecError`: a bad name, a weight of 0 or less, a bad quota or limit."""

    name: TenantName = Field(description="Tenant name: 1-63 letters, digits, '.', '_', '-' (a job's --tenant).")
    quota: Resources = Field(default_factory=Resources, description=(
        "The compute guaranteed to the tenant: its jobs within it start before any tenant's borrowing, and "
        "capacity lent to others is taken back for them by preemption."))
    weight: float = Field(1.0, gt=0, le=1_000_000, strict=True, allow_inf_nan=False,
                          description="The tenant's fair share, relative to the others' weights.")
    borrow_limit: BorrowLimit | None = Field(None, description=(
        "How much idle capacity beyond its quota the tenant may use, per resource (left out: any)."))
    members: list[UserName] = Field(default_factory=list, description=(
        "OS user names whose submissions are the tenant's when they name no --tenant."))


def tenant_rules(tenants: Any, totals: tuple[int, int, int] | None) -> list[RuleError]:
    """The pool-level rules on ``tenants`` (the raw ``tenants`` list): unique names, a member in one
    tenant only, and quotas that the pool can hold, each alone and together (``totals``: the pool's
    GPUs, CPUs and memory bytes; None: not checked).  Each problem with its field path."""
    if not isinstance(tenants, list):
        return []
    problems: list[RuleError] = []
    named: dict[str, int] = {}
    member_of: dict[str, int] = {}
    sums = [0, 0, 0]
    for index, tenant in enumerate(tenants):
        if not isinstance(tenant, Mapping):
            continue
        name = tenant.get("name")
        if isinstance(name, str):
            if name in named:
                problems.append(((index, "name"), spec_error(
                    f"tenant {name!r} is also declared by tenants[{named[name]}]", fix="give each tenant its own name",
                    got=short_repr(name)), name))
            named.setdefault(name, index)
        members = tenant.get("members")
        for m_index, member in enumerate(members if isinstance(members, list) else []):
            if not isinstance(member, str):
                continue
            if member in member_of and member_of[member] == index:
                problems.append(((index, "members", m_index), spec_error(
                    f"user {member!r} is listed twice in this tenant", fix="list each user once",
                    got=short_repr(member)), member))
            elif member in member_of:
                other = tenants[member_of[member]]
                problems.append(((index, "members", m_index), spec_error(
                    f"user {member!r} is also a member of tenant {other.get('name')!r} (tenants[{member_of[member]}])",
                    fix="list each user in one tenant (a job names another with --tenant)", got=short_repr(member)),
                    member))
            member_of.setdefault(member, index)
        quota, limit = tenant.get("quota"), tenant.get("borrow_limit")
        if isinstance(quota, Mapping) and isinstance(limit, Mapping):
            guaranteed = [k for k in ("gpus", "cpus", "memory") if quota.get(k) is not None]
            for key in ("gpus", "cpus", "memory"):
                if guaranteed and limit.get(key) is not None and key not in guaranteed:
                    problems.append(((index, "borrow_limit", key), spec_error(
                        f"bounds nothing: a borrow_limit bounds only what the quota names, and this tenant's quota "
                        f"names no {key}", fix=f"add {key} to its quota (0 for none guaranteed), or leave it out here",
                        got=short_repr(limit.get(key))), limit.get(key)))
        if totals is None or not isinstance(quota, Mapping):
            continue
        for k, key in enumerate(("gpus", "cpus", "memory")):
            value = _amount(quota.get(key), key)
            if value is None:
                continue
            sums[k] += value
            if value > totals[k]:
                problems.append(((index, "quota", key), spec_error(
                    f"is more than the pool has ({_say(totals[k], key)})", fix="lower it, or add nodes",
                    got=_say(value, key)), quota.get(key)))
    if totals is not None:
        for k, key in enumerate(("gpus", "cpus", "memory")):
            if sums[k] > totals[k] and not any(p[0][1:] == ("quota", key) for p in problems):
                problems.append(((), spec_error(
                    f"the tenants' quotas of {key} add up to more than the pool's {_say(totals[k], key)}",
                    fix="lower the quotas: a quota is a guarantee, and the pool must hold all of them at once",
                    got=_say(sums[k], key)), None))
    return problems


def _amount(value: Any, key: str) -> int | None:
    """A quota field's amount (bytes for memory), or None when it is not valid (its own error says so)."""
    if key != "memory":
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
    from .units import parse_memory

    try:
        return parse_memory(value) if value is not None else None
    except (ValueError, TypeError):
        return None


def _say(value: int, key: str) -> str:
    if key != "memory":
        return f"{value:,}"
    from .units import format_memory

    return format_memory(value)
