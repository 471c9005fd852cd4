"""The pool declaration: the machines a queue places jobs on (YAML or JSON, ``pool_version: 1``).

    pool_version: 1
    name: lab
    nodes:
      - {name: a100, count: 125, gpus: 8, gpu_type: A100, cpus: 64, memory: 512GiB}
      - {name: cpu-big, cpus: 192, memory: 1.5TiB}
    preemption: {min_run: 10m, max_per_day: 4}   # optional
    tenants:                                      # optional: the teams sharing it (e31.specs.tenants)
      - {name: vision, quota: {gpus: 16}, weight: 2, members: [alice]}
    fair_share: {half_life: 7d}                   # optional

A node line with ``count: N`` (N > 1) stands for N identical nodes named
``NAME-1`` ... ``NAME-N``; with ``count: 1`` (the default) the node is named
``NAME``.  Node names are unique after this expansion.  Loaded like a job spec
(:func:`load_pool`): every problem at once, each with its field path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictInt, WithJsonSchema

from .base import RuleError, SpecModel, spec_error
from .errors import DOCUMENT, Problem, SpecError, short_repr
from .fields import SAFE_NAME, GpuType, Grace, JobName, Memory, valid_job_name
from .friendly import Vocabulary, register_document
from .loader import _parse_text, _read
from .tenants import DEFAULT_TENANT, BorrowLimit, FairShare, Resources, TenantSpec, tenant_rules

__all__ = ["MAX_NODES", "NodeSpec", "PoolSpec", "PreemptionPolicy", "load_pool", "parse_pool", "pool_json_schema"]

#: Most nodes a pool may declare once ``count`` is expanded.
MAX_NODES = 100_000


def _node_name(value: str) -> str:
    if not valid_job_name(value):
        raise spec_error("must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit",
                         fix="e.g. gpu or a100 (count: N names the nodes a100-1..a100-N)")
    return value


#: A node name (or the prefix of numbered names).
NodeName = Annotated[str, AfterValidator(_node_name), WithJsonSchema({"type": "string", "pattern": SAFE_NAME})]


class NodeSpec(SpecModel):
    """One node line of a pool: its resources and how many identical nodes it stands for.

    ``memory`` is in BYTES (``512GiB`` etc. accepted).  Raises (on validation)
    :class:`SpecError` (pydantic's ValidationError inside another model): a bad
    name, a count below 1, negative GPUs, fewer than 1 CPU, a ``gpu_type`` on a
    node without GPUs.
    """

    name: NodeName = Field(description="Node name (or the prefix of NAME-1..NAME-N when count > 1).")
    count: StrictInt = Field(1, ge=1, le=MAX_NODES, description="How many identical nodes this line declares.")
    gpus: StrictInt = Field(0, ge=0, le=64, description="GPU devices per node (whole devices, numbered from 0; at most 64).")
    gpu_type: GpuType | None = Field(None, description="GPU model of the node, e.g. H100; jobs naming one run only on such nodes.")
    cpus: StrictInt = Field(ge=1, description="CPU cores per node.")
    memory: Memory = Field(description="Memory per node in bytes, or a size such as 512GiB.")
    group: NodeName | None = Field(None, description=(
        "The network group of these nodes (a rack, a switch): a multi-node job prefers nodes of one group."))
    scratch_budget: Memory | None = Field(None, description=(
        "Bytes of staged inputs the node's scratch may keep (a size such as 500GiB). With it, the node's e31 worker "
        "prefetches the inputs of jobs planned on it while they wait, evicting the least recently used staged "
        "copies to stay within it; without it, inputs are staged when a job starts."))

    @classmethod
    def _rules(cls, data: Mapping[str, Any]) -> list[RuleError]:
        if data.get("gpu_type") is not None and data.get("gpus", 0) == 0:
            err = spec_error("names a GPU model for a node without GPUs", fix="add gpus: N or remove gpu_type",
                             got=short_repr(data["gpu_type"]))
            return [(("gpu_type",), err, data["gpu_type"])]
        return []

    def names(self) -> list[str]:
        """The node names this line stands for: ``[name]``, or ``name-1`` ... ``name-count``."""
        if self.count == 1:
            return [self.name]
        return [f"{self.name}-{i}" for i in range(1, self.count + 1)]


class PreemptionPolicy(SpecModel):
    """How a pool's queue may preempt jobs (``request.preemptible``) for jobs with priority over them.

    ``min_run`` (a duration, default 10 minutes; 0: none): a job is never preempted before it has run this
    long in its current run, counted from its flow run's ``Running`` (its staging included), so that jobs
    do not thrash (Slurm's ``PreemptExemptTime`` plays the same part).  ``attained_min_run`` (default 1 hour):
    the same bound for a preemption in favour of a job that has received less service (jobs that declare no
    duration, :mod:`e31.flows.placement.attained`), whose restarts cost more than they save when they come
    often; measured on the Lublin-Feitelson model and the Philly trace (``docs/performance.md``).
    ``max_per_day`` (default none: no
    cap; 0: the pool never preempts): at most this many preemptions of one job in any 24 hours; once
    reached, the job runs on unpreempted.  Raises (on validation) :class:`SpecError`: a negative or
    unreadable duration, a negative count.
    """

    min_run: Grace = Field(timedelta(minutes=10), description=(
        "A job is not preempted before it has run this long in its current run, e.g. 10m (0: no minimum)."))
    attained_min_run: Grace = Field(timedelta(hours=1), description=(
        "A job is not preempted for a job that has received less service (attained service) before it has run "
        "this long in its current run, e.g. 1h; a deadline at risk or a tenant's quota needs only min_run."))
    max_per_day: StrictInt | None = Field(None, ge=0, le=10_000, description=(
        "At most this many preemptions of one job in any 24 hours (none: no cap)."))


class PoolSpec(SpecModel):
    """A pool of nodes (see the module docstring for the ``count`` naming).

    Raises (on validation) :class:`SpecError`, worded as :func:`load_pool` words it
    (source ``<pool>``): no nodes, duplicate node names after expansion, more
    than :data:`MAX_NODES` nodes, or a bad node line.
    """

    pool_version: Literal[1] = Field(1, description="Pool format version; 1.")
    name: JobName = Field("pool", description="Pool name: 1-63 letters, digits, '.', '_', '-'.")
    nodes: list[NodeSpec] = Field(min_length=1, description="Node lines; each may stand for several identical nodes.")
    preemption: PreemptionPolicy = Field(default_factory=PreemptionPolicy, title="Preemption", description=(
        "When a job that may be preempted (request.preemptible) gives way to one with priority over it."))
    tenants: list[TenantSpec] = Field(default_factory=list, max_length=10_000, description=(
        "The teams sharing the pool: each with a quota it is guaranteed, a weight (its fair share), a borrow "
        "limit and its members. None declared: every job is tenant default's."))
    fair_share: FairShare = Field(default_factory=FairShare, title="Fair share", description=(
        "How tenants' past usage is weighed: it counts half as much after half_life."))

    @classmethod
    def _rules(cls, data: Mapping[str, Any]) -> list[RuleError]:
        nodes = data.get("nodes")
        if not isinstance(nodes, list):
            return []
        owner: dict[str, int] = {}
        total, problems = 0, []
        for index, line in enumerate(nodes):
            if not isinstance(line, Mapping) or not isinstance(line.get("name"), str):
                continue
            count = line.get("count", 1)
            count = count if isinstance(count, int) and not isinstance(count, bool) and 1 <= count <= MAX_NODES else 1
            total += count
            names = [line["name"]] if count == 1 else [f"{line['name']}-{i}" for i in range(1, count + 1)]
            clash = next((n for n in names if n in owner), None)
            if clash is not None:
                err = spec_error(f"node name {clash!r} is also declared by nodes[{owner[clash]}]",
                                 fix="give each node line its own name (count: N names them NAME-1..NAME-N)",
                                 got=short_repr(line["name"]))
                problems.append((("nodes", index, "name"), err, line["name"]))
            for n in names:
                owner.setdefault(n, index)
        if total > MAX_NODES:
            err = spec_error(f"must declare at most {MAX_NODES:,} nodes", got=f"{total:,} with counts expanded")
            problems.append((("nodes",), err, None))
        problems += [(("tenants", *loc), err, value) for loc, err, value in
                     tenant_rules(data.get("tenants"), _totals(nodes))]
        return problems

    def tenant(self, name: str) -> TenantSpec | None:
        """The tenant ``name`` (``default``, when not declared: no quota, weight 1), or None: the pool has
        no such tenant."""
        found = next((t for t in self.tenants if t.name == name), None)
        if found is None and name == DEFAULT_TENANT:
            return TenantSpec(name=DEFAULT_TENANT)
        return found

    def tenant_of(self, user: str) -> str:
        """The tenant whose ``members`` include the OS user ``user``, else ``default``."""
        return next((t.name for t in self.tenants if user in t.members), DEFAULT_TENANT)

    def tenant_names(self) -> list[str]:
        """Every tenant's name, ``default`` included (declared or not)."""
        names = [t.name for t in self.tenants]
        return names if DEFAULT_TENANT in names else [*names, DEFAULT_TENANT]

    def node_lines(self) -> list[tuple[str, NodeSpec]]:
        """Every node as ``(name, its line)``, in declaration order, ``count`` expanded."""
        return [(name, line) for line in self.nodes for name in line.names()]


def _totals(nodes: Any) -> tuple[int, int, int] | None:
    """The pool's GPUs, CPUs and memory bytes from its raw node lines, or None when a line is not valid
    (its own errors say so; the tenants' quotas are then not checked against it)."""
    from .units import parse_memory

    sums = [0, 0, 0]
    for line in nodes:
        if not isinstance(line, Mapping):
            return None
        count, gpus, cpus = line.get("count", 1), line.get("gpus", 0), line.get("cpus")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (count, gpus, cpus)):
            return None
        try:
            memory = parse_memory(line.get("memory"))
        except (ValueError, TypeError):
            return None
        sums = [sums[0] + count * gpus, sums[1] + count * cpus, sums[2] + count * memory]
    return sums[0], sums[1], sums[2]


_POOL_WORDS = Vocabulary(
    models={(): PoolSpec, ("nodes",): NodeSpec, ("preemption",): PreemptionPolicy, ("tenants",): TenantSpec,
            ("tenants", "quota"): Resources, ("tenants", "borrow_limit"): BorrowLimit, ("fair_share",): FairShare},
    add={("nodes",): "add e.g. nodes: [{name: gpu, count: 4, gpus: 8, cpus: 64, memory: 512GiB}]",
         ("nodes", "name"): "add e.g. name: gpu",
         ("nodes", "cpus"): "add e.g. cpus: 64",
         ("nodes", "memory"): "add e.g. memory: 512GiB",
         ("tenants", "name"): "add e.g. name: vision"},
    mapping_of={(): "pool_version, name, nodes, preemption, tenants, fair_share",
                ("preemption",): "min_run, attained_min_run, max_per_day",
                ("nodes",): "name, count, gpus, gpu_type, cpus, memory, group, scratch_budget",
                ("tenants",): "name, quota, weight, borrow_limit, members",
                ("tenants", "quota"): "gpus, cpus, memory", ("tenants", "borrow_limit"): "gpus, cpus, memory",
                ("fair_share",): "half_life"},
)

register_document(_POOL_WORDS, "pool", "<pool>")  # PoolSpec(...) from Python raises SpecError worded as load_pool's

#: Path of a problem about the whole pool document.
WHOLE = "(pool)"


def _whole(problem: Problem) -> Problem:
    return Problem(WHOLE, problem.message.replace("not a spec file", "not a pool file")) if problem.path == DOCUMENT else problem


def parse_pool(data: Any, source: str = "<pool>") -> PoolSpec:
    """Validate a pool given as a mapping (parsed YAML/JSON).

    Raises:
        SpecError: (``invalid pool SOURCE (N problems)``) every problem at once.
    """
    if not isinstance(data, Mapping):
        got = "an empty document" if data is None else short_repr(data)
        raise SpecError(source, [Problem(WHOLE, f"the document must be a mapping of pool_version, name, nodes (got {got})")],
                        what="pool")
    try:
        return PoolSpec.model_validate(dict(data))
    except SpecError as exc:
        raise SpecError(source, exc.problems, what="pool") from None


def load_pool(path: str | os.PathLike[str]) -> PoolSpec:
    """Load and validate a pool file (``.json`` as JSON, anything else as YAML, read as job specs are).

    Raises:
        SpecError: the file cannot be read, is not valid YAML/JSON, has
            duplicate keys, or declares an invalid pool; every problem at once,
            headed ``invalid pool PATH (N problems)``. No other exception escapes.
    """
    source = os.fspath(path)
    try:
        data, early = _parse_text(_read(path, source), source, as_json=source.lower().endswith(".json"), model=PoolSpec)
    except SpecError as exc:
        raise SpecError(source, [_whole(p) for p in exc.problems], what="pool") from None
    try:
        pool = parse_pool(data, source)
    except SpecError as exc:
        raise SpecError(source, early + exc.problems, what="pool") from None
    if early:
        raise SpecError(source, early, what="pool")
    return pool


def pool_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a pool file; a new dict on each call."""
    schema = PoolSpec.model_json_schema(mode="validation")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "E31 pool",
        "description": "The nodes an E31 queue places jobs on; a node line with count: N declares N identical nodes.",
        **{k: v for k, v in schema.items() if k not in ("title", "description")},
    }

