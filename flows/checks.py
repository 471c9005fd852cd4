"""Checks of a spec that need this machine, run with the spec's own validation
so every problem is reported at once: URLs whose fsspec protocol is unknown
or not installed here, and a Python entrypoint whose function does not exist.

Nothing is contacted and no work code runs: the entrypoint's module is found
with :func:`importlib.util.find_spec` and its source read with :mod:`ast`.
Used by ``e31 validate``, ``compile``, ``run`` and ``deploy`` through
``load_spec(..., checks=...)``.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib.util
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from e31.specs import Problem, mask_url
from e31.specs.urls import has_protocol


#: Storage protocols people use for data and outputs, and the package that brings each.
STORE_PROTOCOLS = {"file": "fsspec", "memory": "fsspec", "http": "fsspec", "https": "fsspec", "s3": "s3fs",
                   "gs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def known_protocols() -> tuple[list[str], list[str]]:
    """The storage protocols of :data:`STORE_PROTOCOLS` whose fsspec backend
    loads here, and those that need a package installed first."""
    from fsspec.registry import get_filesystem_class

    usable, missing = [], []
    for name in STORE_PROTOCOLS:
        try:
            get_filesystem_class(name)
        except (ImportError, ValueError):
            missing.append(name)
            continue
        usable.append(name)
    return usable, missing


def _urls(data: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    items = data.get("data")
    if isinstance(items, list):
        for index, item in enumerate(items):
            if isinstance(item, Mapping) and isinstance(item.get("url"), str):
                yield f"data[{index}].url", item["url"]
    output = data.get("output")
    if isinstance(output, Mapping):
        if isinstance(output.get("url"), str):
            yield "output.url", output["url"]
        checkpoint = output.get("checkpoint")
        if isinstance(checkpoint, Mapping) and isinstance(checkpoint.get("url"), str):
            yield "output.checkpoint.url", checkpoint["url"]


def protocol_problems(data: Mapping[str, Any]) -> list[Problem]:
    """A :class:`Problem` for each URL of the raw spec ``data`` whose protocol
    fsspec does not know or whose backend is not installed, naming the
    protocols this machine has."""
    from e31.tasks.storage import backend_problem

    problems = []
    known = None
    for field, url in _urls(data):
        if not has_protocol(url):
            continue
        why = backend_problem(url)
        if why is None:
            continue
        protocol = url.split("::")[0].split("://")[0]
        usable, missing = known or known_protocols()
        known = (usable, missing)
        if why.startswith("Protocol not known"):
            needs = ", ".join(f"{p} ({STORE_PROTOCOLS[p]})" for p in missing)
            message = (f"unknown protocol {protocol!r} (got {mask_url(url)}); use a local path or one of "
                       f"{', '.join(usable)}" + (f"; with a package installed: {needs}" if needs else ""))
        else:
            message = f"protocol {protocol!r} is not installed here (got {mask_url(url)}): {why}"
        problems.append(Problem(field, message))
    return problems


@contextlib.contextmanager
def _on_path(folder: str | None) -> Iterator[None]:
    if not folder or folder in sys.path:
        yield
        return
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)


def _top_level_names(source: str) -> tuple[set[str], bool]:
    """Names bound at a module's top level, and whether it may bind others
    dynamically (``from x import *`` or a module ``__getattr__``)."""
    tree = ast.parse(source)
    names: set[str] = set()
    dynamic = False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            dynamic |= node.name == "__getattr__"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    dynamic = True
                names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        names.add(sub.id)
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            dynamic = True  # names bound conditionally: do not claim one is missing
    return names, dynamic


def entrypoint_problems(data: Mapping[str, Any], code_dir: str | None) -> tuple[list[Problem], str | None]:
    """Check ``work.entrypoint`` of the raw spec ``data`` without running any
    work code: the module must be found (``code_dir`` first on the path) and,
    when its source can be read, define the function.  Returns the problems
    and a note when the entrypoint could not be checked here (e.g. its module
    is only installed where the job runs)."""
    work = data.get("work")
    entry = work.get("entrypoint") if isinstance(work, Mapping) else None
    if not isinstance(entry, str) or entry.count(":") != 1:
        return [], None  # the schema reports a malformed entrypoint
    module_name, func = entry.split(":")
    if not module_name or not func:
        return [], None
    with _on_path(code_dir):
        try:
            found = importlib.util.find_spec(module_name)
        except (ImportError, ValueError, AttributeError):
            found = None
    if found is None:
        moved = _e31_module(module_name)
        if moved:
            return [Problem("work.entrypoint", f"no module {module_name!r} (got {entry!r}); did you mean "
                                               f"{moved}:{func}? (E31's own modules are under e31.)")], None
        return [], (f"work.entrypoint {entry!r} not checked: module {module_name!r} is not importable here "
                    "(it must be where the job runs: installed, or beside the spec)")
    origin = found.origin
    if not origin or not origin.endswith(".py"):
        return [], None  # a compiled or namespace module: cannot read its names
    try:
        with open(origin, encoding="utf-8") as fh:
            names, dynamic = _top_level_names(fh.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return [], None
    head = func.split(".")[0]
    if head in names or dynamic:
        return [], None
    public = sorted(n for n in names if not n.startswith("_"))
    close = difflib.get_close_matches(head, public, n=1)
    fix = f"did you mean {module_name}:{close[0]}?" if close else (
        f"functions there: {', '.join(public[:8])}" if public else "the module defines no functions")
    return [Problem("work.entrypoint", f"{module_name} has no {head!r} (got {entry!r}); {fix}")], None


def _e31_module(name: str) -> str | None:
    """The module of the installed ``e31`` package a missing ``name`` most
    likely means: ``e31.<name>`` (a name from before E31 was one package,
    e.g. ``examples.digits``), or the closest ``e31.*`` module to a
    misspelt one (``e31.exmples.digits``); None when ``name`` is not E31's."""
    import importlib
    import pkgutil

    try:
        if importlib.util.find_spec(f"e31.{name}") is not None:
            return f"e31.{name}"
    except (ImportError, ValueError):
        pass
    modules = []
    for sub in ("specs", "tasks", "flows", "deployments", "examples"):
        package = importlib.import_module(f"e31.{sub}")  # light: no package imports Prefect, fsspec or torch
        modules.append(package.__name__)
        modules += [info.name for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
                    if not info.name.split(".")[-1].startswith("_")]
    if name == "e31" or name.startswith("e31."):
        close = difflib.get_close_matches(name, modules, n=1, cutoff=0.8)
        return close[0] if close else None
    return None


class SpecChecks:
    """The machine checks for ``load_spec(..., checks=SpecChecks(code_dir))``:
    calling it returns the problems; :attr:`notes` collects what could not be
    checked here."""

    def __init__(self, code_dir: str | None):
        self.code_dir = code_dir
        self.notes: list[str] = []

    def __call__(self, data: Mapping[str, Any]) -> list[Problem]:
        problems = protocol_problems(data)
        entry, note = entrypoint_problems(data, self.code_dir)
        if note:
            self.notes.append(note)
        return problems + entry
