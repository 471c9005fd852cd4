"""Client TLS contexts whose trusted certificates are read at their first
connection, not at their creation.

Every Prefect client, events client and version check builds its own
``ssl.create_default_context(cafile=certifi.where())`` (Prefect 3.9:
``prefect/client/orchestration/__init__.py``, ``prefect/events/clients.py``,
``prefect/_internal/version_checking.py``), and each parses certifi's
bundle of ~150 certificates: ~30 ms of CPU, even when the API is plain
``http://`` and no TLS connection is ever made.  Measured with
``tests/benchmarks/apicount`` on ``bench_queue.py`` (3 s jobs, 2 cores):
5 such contexts per flow run in its flow process and 2 more in its
worker, ~0.25 CPU-seconds per job, about 6 % of all the CPU a job costs
the machine.

:func:`install` replaces ``ssl.create_default_context`` in this process
(and the processes forked from it) with :func:`create_default_context`:
for a client context (``Purpose.SERVER_AUTH``) it returns a
:class:`LazyTrustContext` set up exactly as the standard library's
(``PROTOCOL_TLS_CLIENT``, ``CERT_REQUIRED``, host names checked,
``SSLKEYLOGFILE``) whose trust store (the ``cafile``/``capath``/``cadata``
given, else the system's default certificates) is loaded just before its
first ``wrap_socket``/``wrap_bio`` (every TLS connection of ``ssl``,
``asyncio``, ``httpx``/``httpcore`` and ``websockets`` goes through one of
them) or a read of the store (``get_ca_certs``, ``cert_store_stats``).
A context is never shared: each caller's changes (``verify_mode``, ALPN,
``load_cert_chain``) stay its own, as before.  What changes: a ``cafile``
that cannot be read raises at each connection (naming the file; an
``OSError`` of the same type, which ``httpx``'s sync client reports as a
``ConnectError`` and its async one as it is) instead of at the client's
creation.  Server contexts (``Purpose.CLIENT_AUTH``) are the
standard library's.

Installed by the ``e31`` command (worker, scheduler, ``e31 run``, ...) and
by the worker's warm flow process (:mod:`e31.deployments.warmstart`);
``E31_LAZY_TLS=0`` leaves ``ssl`` as it is.

Measured on Prefect 3.9.1.  Upstream offers a context per client E31
builds itself (``get_client(httpx_settings={"verify": ctx})``), but none
for the clients Prefect's engine, events and version check build: nothing
upstream makes their trust store lazy or shared.
"""

from __future__ import annotations

import os
import ssl
import sys
import threading
from typing import Any

#: ``0`` keeps the standard library's ``ssl.create_default_context``.
LAZY_TLS_VAR = "E31_LAZY_TLS"

_STDLIB = ssl.create_default_context
_LOCK = threading.Lock()  # one load at a time (a context is loaded once: contention does not matter)


class LazyTrustContext(ssl.SSLContext):
    """A client ``ssl.SSLContext`` whose trust store is loaded at its first
    use (see the module's docstring).  ``_e31_trust``: the
    ``(cafile, capath, cadata)`` still to load, absent once loaded."""

    def _e31_load(self) -> None:
        with _LOCK:
            trust = self.__dict__.pop("_e31_trust", None)
            if trust is None:
                return
            if any(v is not None for v in trust):
                try:
                    super().load_verify_locations(*trust)
                except OSError as exc:  # each connection says so again (and trusts nothing meanwhile)
                    self._e31_trust = trust
                    named = trust[0] or trust[1] or "cadata"
                    raise type(exc)(exc.errno, f"cannot read the trusted certificates {named}: "
                                               f"{exc.strerror or exc}") from exc
            elif self.verify_mode != ssl.CERT_NONE:  # the system's certificates, as the standard library's
                super().load_default_certs(ssl.Purpose.SERVER_AUTH)
            else:  # not verifying now: kept for a later use that verifies again
                self._e31_trust = trust

    def wrap_socket(self, *args: Any, **kwargs: Any) -> Any:
        self._e31_load()
        return super().wrap_socket(*args, **kwargs)

    def wrap_bio(self, *args: Any, **kwargs: Any) -> Any:
        self._e31_load()
        return super().wrap_bio(*args, **kwargs)

    def get_ca_certs(self, *args: Any, **kwargs: Any) -> Any:
        self._e31_load()
        return super().get_ca_certs(*args, **kwargs)

    def cert_store_stats(self) -> Any:
        self._e31_load()
        return super().cert_store_stats()


def create_default_context(purpose: Any = ssl.Purpose.SERVER_AUTH, *, cafile: Any = None, capath: Any = None,
                           cadata: Any = None) -> ssl.SSLContext:
    """``ssl.create_default_context`` with the same arguments and result,
    but for a client context (``purpose`` ``Purpose.SERVER_AUTH``) the
    trust store is loaded at its first use (:class:`LazyTrustContext`).
    Raises ``TypeError``/``ValueError`` for a bad ``purpose``, as the
    standard library does."""
    if purpose != ssl.Purpose.SERVER_AUTH:
        return _STDLIB(purpose, cafile=cafile, capath=capath, cadata=cadata)
    context = LazyTrustContext(ssl.PROTOCOL_TLS_CLIENT)
    context.verify_mode = ssl.CERT_REQUIRED
    context.check_hostname = True
    context._e31_trust = (cafile, capath, cadata) if (cafile or capath or cadata) else (None, None, None)
    keylog = os.environ.get("SSLKEYLOGFILE")
    if hasattr(context, "keylog_filename") and keylog and not sys.flags.ignore_environment:
        context.keylog_filename = keylog
    return context


def install() -> bool:
    """Make ``ssl.create_default_context`` this module's in this process
    (unless ``E31_LAZY_TLS=0``); True when it is.  Modules that imported the
    function by name before keep the standard library's."""
    if os.environ.get(LAZY_TLS_VAR, "1") == "0":
        return False
    ssl.create_default_context = create_default_context
    return True
