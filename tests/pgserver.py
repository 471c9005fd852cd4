"""A real PostgreSQL server for tests and benchmarks: a private cluster of Debian's ``postgresql``.

Used by the PostgreSQL tests and ``bench_queue.py --database postgresql``, so nothing here imports
pytest::

    with postgres(Path(tmp)) as pg:         # initdb, start on 127.0.0.1:PORT, createdb prefect
        pg.url                               # postgresql+asyncpg://postgres@127.0.0.1:PORT/prefect
        pg.restart()                         # pg_ctl restart -m fast: every connection is dropped

PostgreSQL refuses to run as root: the cluster is made and run as the ``postgres`` user (Debian's
package creates it), in a folder of its own that user owns (``initdb -A trust``: no password, and
the server listens on 127.0.0.1 and a socket in that folder only).  Debian keeps the programs in
``/usr/lib/postgresql/<version>/bin``, off the PATH.  Stopped on exit (``pg_ctl stop -m immediate``)
and its folder removed.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["PgServer", "bin_dir", "postgres", "unavailable"]


def bin_dir() -> Path | None:
    """Debian's PostgreSQL programs folder (the newest version installed), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def unavailable() -> str | None:
    """Why a PostgreSQL server cannot be started here, or None."""
    if bin_dir() is None:
        return "PostgreSQL is not installed (apt-get install postgresql; .ci/run does)"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "no postgres user (Debian's postgresql package creates it)"
    if os.geteuid() != 0:
        return "the private cluster is run as the postgres user, which needs root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    """A running private cluster: ``port``, ``url`` (for Prefect's
    ``PREFECT_SERVER_DATABASE_CONNECTION_URL``), ``root`` (its folder), ``log``."""

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.bin = bin_dir()
        self.data, self.sock, self.log = root / "data", root / "sock", root / "postgres.log"
        self.url = f"postgresql+asyncpg://postgres@127.0.0.1:{port}/prefect"

    def _as_postgres(self, *argv: str, timeout: float = 120) -> None:
        done = subprocess.run(["runuser", "-u", "postgres", "--", *argv], capture_output=True, text=True,
                              timeout=timeout, cwd=self.root)
        if done.returncode:
            raise RuntimeError(f"{Path(argv[0]).name} failed ({done.returncode}): {done.stderr.strip()[-800:]}; "
                               f"log {self.log}")

    def start(self) -> PgServer:
        """initdb (once), start, and create the ``prefect`` database (once)."""
        first = not self.data.exists()
        if first:
            self._as_postgres(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres")
        self._as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-o",
                          f"-p {self.port} -k {self.sock} -c listen_addresses=127.0.0.1", "start")
        if first:
            self._as_postgres(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                              "prefect")
        return self

    def restart(self) -> None:
        """Stop (fast: every connection dropped) and start again on the same port."""
        self._as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        self.start()

    def stop(self) -> None:
        """Stop at once (the tests' data is thrown away)."""
        if (self.data / "postmaster.pid").exists():
            self._as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")


@contextmanager
def postgres(parent: Path | None = None) -> Iterator[PgServer]:
    """Start a private cluster in a new folder under ``parent`` (default: the system's temporary folder;
    the ``postgres`` user must be able to reach it), yield the :class:`PgServer`, stop and remove it."""
    root = Path(tempfile.mkdtemp(prefix="e31-pg-", dir=parent))
    os.chmod(root, 0o755)
    (root / "sock").mkdir()
    user = pwd.getpwnam("postgres")
    for path in (root, root / "sock"):
        os.chown(path, user.pw_uid, user.pw_gid)
    server = PgServer(root, _free_port())
    try:
        yield server.start()
    finally:
        try:
            server.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)
