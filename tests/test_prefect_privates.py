"""The private members of Prefect that E31 relies on: one list
(:data:`PRIVATES`), and a test that fails naming each one that is gone or
changed in the installed Prefect.

``pyproject.toml`` declares the Prefect range CI tests (``prefect>=3.9,<3.10``,
measured on 3.9.1).  Prefect may rename or reshape any of these in a patch
release; E31 would then fail at run time, some of it silently (a quick
503 resend or a cancel gate that no longer wraps anything).  This test
makes such a release fail CI instead, naming the member and the E31 module
that uses it.  A second test keeps the list whole: every private Prefect
import in the product's folders is on it.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The product's folders (the ones the wheel installs as ``e31.*``).
PRODUCT = ("e31", "specs", "tasks", "flows", "deployments")


@dataclass(frozen=True)
class Private:
    """One private member: ``owner`` is ``module`` or ``module:Class``;
    ``kind`` says how it is checked:

    - ``attribute``: a class attribute, or (for ``BaseWorker``,
      ``ProcessWorker``, ``SyncPrefectClient``, ``PrefectClient``,
      ``StateProposer``) an attribute of a fresh instance;
    - ``pydantic``: a pydantic private attribute of the model;
    - ``callable``: a function or method whose parameters are ``params``
      (names, in order, ``self``/``cls`` left out);
    - ``module``: an importable module;
    - ``logger``: a logger that Prefect's logging configuration defines;
    - ``text``: a log text that the source of module ``owner`` still writes
      (E31's log filters match it).

    ``read_by``: a function of Prefect's that must still read the member
    (E31 sets it for that function to see).  ``used_by``: the E31 module and
    what it does with it."""

    owner: str
    name: str
    kind: str
    used_by: str
    params: tuple[str, ...] | None = None
    read_by: str | None = None


_WORKER = "prefect.workers.base:BaseWorker"
#: Every private member of Prefect (and of the httpx client inside Prefect's client) that E31 relies on.
PRIVATES: tuple[Private, ...] = (
    # the e31 worker (deployments/worker.py), a subclass of Prefect's process worker
    Private(_WORKER, "_work_pool_name", "attribute", "deployments/worker.py: the pool it polls and its warm process"),
    Private(_WORKER, "_client", "attribute", "deployments/worker.py: its API client (quick 503 resends, clock)"),
    Private(_WORKER, "_runs_task_group", "attribute", "deployments/worker.py: labels and cut returns beside runs"),
    Private(_WORKER, "_logger", "attribute", "deployments/worker.py: the worker's log"),
    Private(_WORKER, "_prefetch_seconds", "attribute", "deployments/worker.py: prefetch widened by the clock skew",
            read_by="prefect.workers.base:BaseWorker._get_scheduled_flow_runs"),
    Private(_WORKER, "_get_scheduled_flow_runs", "callable", "deployments/worker.py: runs not placed here dropped",
            params=()),
    Private(_WORKER, "_give_worker_labels_to_flow_run", "callable", "deployments/worker.py: labels beside the start",
            params=("flow_run_id",)),
    Private(_WORKER, "kill_infrastructure", "callable", "deployments/worker.py: overridden (public, documented: "
            "a return in progress is waited for)", params=("infrastructure_pid", "configuration", "grace_seconds")),
    Private(_WORKER, "_description", "attribute", "deployments/worker.py: the worker type's description"),
    Private(_WORKER, "_display_name", "attribute", "deployments/worker.py: the worker type's name in the UI"),
    Private(_WORKER, "_documentation_url", "attribute", "deployments/worker.py: the worker type's documentation"),
    Private("prefect.workers.base:BaseJobConfiguration", "_base_environment", "callable",
            "deployments/jobconfig.py: the flow processes' environment, computed once per settings", params=()),
    Private("prefect.workers.process:ProcessJobConfiguration", "_command_configured", "pydantic",
            "deployments/jobconfig.py: E31's flow-process command used as given",
            read_by="prefect.workers.process:ProcessWorker.run"),
    # the warm flow process (deployments/warmstart.py, deployments/warmprep.py)
    Private("prefect.flow_engine", "_load_flow_from_runtime_entrypoint", "callable",
            "deployments/warmstart.py: E31's flow loaded before the forks", params=("entrypoint",)),
    Private("prefect.types._datetime", "now", "callable", "deployments/warmprep.py: the related-resource cache's time",
            params=("tz",)),
    # the cancel gate (e31/prefect_compat/cancelgate.py) and the hook (flows/cancelhook.py)
    Private("prefect.runner._cancellation_manager:CancellationManager", "cancel", "callable",
            "e31/prefect_compat/cancelgate.py: no kill of a run whose work ended", params=("flow_run", "state_msg")),
    Private("prefect.runner._state_proposer:StateProposer", "propose_cancelled", "callable",
            "e31/prefect_compat/cancelgate.py: no Cancelled forced over a final state",
            params=("flow_run", "state_updates")),
    Private("prefect.runner._state_proposer:StateProposer", "_client", "attribute",
            "e31/prefect_compat/cancelgate.py: the run's state read before Cancelled is proposed"),
    Private("prefect.runner._workspace_runtime_bootstrap", "", "module",
            "flows/cancelhook.py: a hook run in Prefect's workspace process is told by its file name"),
    # Prefect's API clients (e31/prefect_compat/busy.py: quick 503 resends; e31/prefect_compat/clock.py: server clock)
    Private("prefect.client.orchestration:SyncPrefectClient", "_client", "attribute",
            "e31/prefect_compat/busy.py, e31/prefect_compat/clock.py: the httpx client under Prefect's client"),
    Private("prefect.client.orchestration:PrefectClient", "_client", "attribute",
            "e31/prefect_compat/busy.py, e31/prefect_compat/clock.py: the httpx client under Prefect's client"),
    Private("httpx:Client", "_transport", "attribute", "e31/prefect_compat/busy.py: wrapped by the quick 503 resends"),
    Private("httpx:Client", "_mounts", "attribute", "e31/prefect_compat/busy.py: proxies' transports, wrapped too"),
    Private("httpx:AsyncClient", "_transport", "attribute", "e31/prefect_compat/busy.py: wrapped by the quick resends"),
    # log filtering (e31/prefect_compat/runlog.py, tasks/storage/masking.py)
    Private("prefect.logging", "prefect._internal", "logger",
            "e31/prefect_compat/runlog.py, tasks/storage/masking.py: Prefect's services log there, not propagated"),
    Private("prefect._internal.concurrency.services", "failed to process item", "text",
            "e31/prefect_compat/runlog.py: a service's send failures said once a minute while the API is down"),
    Private("prefect.events.clients", "Unable to connect to", "text",
            "e31/prefect_compat/runlog.py: the events client's failures said once a minute while the API is down"),
    Private("prefect.flow_engine", "exited with unexpected exception", "text",
            "e31/prefect_compat/runlog.py: the engine's traceback of a failure E31 explained is dropped"),
    Private("prefect.engine", "exited with unexpected exception", "text",
            "e31/prefect_compat/runlog.py: the engine's traceback of a failure E31 explained is dropped"),
)


def _instance(cls: type) -> object:
    """A fresh instance of the classes whose private attributes are set in ``__init__``."""
    import httpx

    from prefect.client.orchestration import PrefectClient, SyncPrefectClient
    from prefect.runner._state_proposer import StateProposer
    from prefect.workers.base import BaseWorker
    from prefect.workers.process import ProcessWorker

    if issubclass(cls, BaseWorker):
        return ProcessWorker(work_pool_name="e31-privates-guard")
    if cls in (SyncPrefectClient, PrefectClient):
        return cls("http://127.0.0.1:9/api")
    if cls is StateProposer:
        return StateProposer(client=object())
    if cls in (httpx.Client, httpx.AsyncClient):
        return cls()
    return cls


def _resolve(owner: str) -> object:
    module, _, qualname = owner.partition(":")
    obj: object = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _logger_defined(name: str) -> bool:
    import yaml

    import prefect.logging

    config = yaml.safe_load((Path(prefect.logging.__file__).parent / "logging.yml").read_text())
    return name in (config.get("loggers") or {})


def problems(privates: tuple[Private, ...] = PRIVATES) -> list[str]:
    """One line per member of ``privates`` that is gone or changed in the
    installed Prefect, naming it and its E31 user; empty when all hold."""
    found: list[str] = []
    for p in privates:
        where = f"{p.owner}{'.' + p.name if p.kind not in ('module', 'logger', 'text') else ''}"
        try:
            if p.kind == "module":
                importlib.import_module(p.owner)
                continue
            if p.kind == "text":
                module = importlib.import_module(p.owner)
                if p.name not in inspect.getsource(module):
                    found.append(f"{p.owner} no longer logs {p.name!r} (used by {p.used_by})")
                continue
            if p.kind == "logger":
                if not _logger_defined(p.name):
                    found.append(f"logger {p.name!r} is no longer in Prefect's logging.yml (used by {p.used_by})")
                continue
            owner = _resolve(p.owner)
            if p.kind == "pydantic":
                if p.name not in getattr(owner, "__private_attributes__", {}):
                    found.append(f"{where} is no longer a private attribute of the model (used by {p.used_by})")
            elif p.kind == "attribute":
                target = _instance(owner) if isinstance(owner, type) else owner
                if not hasattr(target, p.name) and not hasattr(owner, p.name):
                    found.append(f"{where} is gone (used by {p.used_by})")
            elif p.kind == "callable":
                member = getattr(owner, p.name, None)
                if not callable(member):
                    found.append(f"{where} is gone (used by {p.used_by})")
                else:
                    params = tuple(n for n in inspect.signature(member).parameters if n not in ("self", "cls"))
                    if params != p.params:
                        found.append(f"{where} takes {params}, not {p.params} (used by {p.used_by})")
            else:
                found.append(f"{where}: unknown kind {p.kind!r}")
            if p.read_by is not None:
                reader = _resolve(p.read_by)
                if p.name not in inspect.getsource(reader):
                    found.append(f"{where} is no longer read by {p.read_by} (used by {p.used_by})")
        except (ImportError, AttributeError) as exc:
            found.append(f"{where}: {type(exc).__name__}: {exc} (used by {p.used_by})")
    return found


def test_every_private_prefect_member_e31_relies_on_is_there():
    from importlib.metadata import version

    found = problems()
    assert found == [], (f"Prefect {version('prefect')} changed {len(found)} private member(s) E31 relies on "
                         "(tests/test_prefect_privates.py PRIVATES):\n" + "\n".join(found))


def test_the_guard_names_a_member_that_is_gone_or_changed():
    gone = Private(_WORKER, "_no_such_member", "attribute", "nothing")
    changed = Private("prefect.runner._cancellation_manager:CancellationManager", "cancel", "callable", "nothing",
                      params=("flow_run",))
    unread = Private(_WORKER, "_logger", "attribute", "nothing",
                     read_by="prefect.workers.base:BaseWorker._give_worker_labels_to_flow_run")
    reworded = Private("prefect.flow_engine", "exited with an expected exception", "text", "nothing")
    assert problems((gone, changed, unread, reworded)) == [
        "prefect.workers.base:BaseWorker._no_such_member is gone (used by nothing)",
        "prefect.runner._cancellation_manager:CancellationManager.cancel takes ('flow_run', 'state_msg'), not "
        "('flow_run',) (used by nothing)",
        "prefect.workers.base:BaseWorker._logger is no longer read by "
        "prefect.workers.base:BaseWorker._give_worker_labels_to_flow_run (used by nothing)",
        "prefect.flow_engine no longer logs 'exited with an expected exception' (used by nothing)",
    ]


#: A private module of Prefect's imported, or a private name imported from Prefect.
_PRIVATE_IMPORT = re.compile(r"^\s*(?:from\s+(prefect[\w.]*)\s+import\s+(\([^)]*\)|[\w, ]+)|import\s+(prefect[\w.]*))",
                             re.MULTILINE)


def test_every_private_prefect_import_of_the_product_is_on_the_list():
    listed = {(p.owner.partition(":")[0], p.name) for p in PRIVATES} | {(p.owner, "") for p in PRIVATES}
    listed |= {(p.owner.partition(":")[0], p.owner.partition(":")[2].split(".")[0]) for p in PRIVATES}
    unlisted = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for m in _PRIVATE_IMPORT.finditer(path.read_text()):
                module = m.group(1) or m.group(3)
                names = [n.strip(" ()\n") for n in (m.group(2) or "").split(",") if n.strip(" ()\n")]
                private_module = any(part.startswith("_") for part in module.split("."))
                for name in names or [""]:
                    if (private_module or name.startswith("_")) and (module, name) not in listed \
                            and (module, "") not in listed:
                        unlisted.append(f"{path.relative_to(ROOT)}: from {module} import {name}")
    assert unlisted == [], "private Prefect imports not in PRIVATES:\n" + "\n".join(unlisted)
