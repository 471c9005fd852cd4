"""E31's work-arounds of Prefect behaviour, in one place.

Each module works around one behaviour of Prefect 3.9 (measured on 3.9.1,
the range ``pyproject.toml`` declares: ``prefect>=3.9,<3.10``) and says in
its docstring what it guards against and what Prefect offers instead, if
anything.  The private Prefect members they (and the ``e31`` worker) rely
on are listed in ``tests/test_prefect_privates.py``, which fails naming a
member a Prefect release removes or changes.

Importable from every layer of E31 (``e31.tasks`` included): nothing here
imports ``e31.flows`` or ``e31.deployments`` at module level.
"""
