"""Separate hosts on one machine: Linux network namespaces joined by a bridge.

Used by the multi-host tests and benchmarks, so nothing here imports pytest::

    with Hosts(3, root=tmp_path) as hosts:          # hosts 0, 1, 2: 10.231.0.1 .. 10.231.0.3
        server = hosts.popen(0, ["python", "-m", "prefect", "server", "start", "--host", hosts.address(0)])
        hosts.cut(2)                                # host 2's link down: it reaches nobody
        hosts.restore(2)

Each host is a network namespace of its own (``e31<tag>-h<i>``) with a loopback and one interface,
``eth0``, addressed ``10.231.0.<i+1>/24``; the other end of each host's cable is a port of a bridge
that lives in one more namespace (``e31<tag>-sw``), the switch.  The addresses exist only inside
these namespaces: the machine's own namespace gets no interface, no address and no route, so no
traffic leaves the hosts' network and nothing outside can reach it.  The hosts share the machine's
file system and processes' view (they are network namespaces only): what a test gives each host of
its own (its scratch, its Prefect home) is a folder apart.

A cut (:meth:`Hosts.cut`) takes the host's switch port down: the host's own interface stays up, so its
processes see a silent network (connections time out), as when a cable or a switch fails.
``tc netem`` is not available in this kernel, so a slow link is left to a user-space proxy.

Everything is torn down on exit: each process still in a namespace is killed (SIGKILL) and the
namespaces, with their interfaces, are deleted.  Needs root (``ip netns add``); :func:`unavailable`
says why not, for a skip.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, TypeVar

from tests.procs import stop_group

__all__ = ["Hosts", "in_netns", "unavailable"]

SUBNET = "10.231.0"
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (not root, no ``ip``, the kernel refuses), or None."""
    if os.geteuid() != 0:
        return "separate hosts are network namespaces, and making them needs root"
    name = f"e31probe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", name)
    except (OSError, RuntimeError) as exc:
        return f"cannot make a network namespace ({exc})"
    _ip("netns", "del", name)
    return None


@contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Move the calling thread into network namespace ``name`` (``ip netns``'s) for the block, and
    back after: sockets the thread opens meanwhile are that host's.  Only this thread moves (setns(2)
    is per thread), so call it from a thread of your own (:meth:`Hosts.call`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
        try:
            yield
        finally:
            if libc.setns(home, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back home")
    finally:
        os.close(target)
        os.close(home)


class Hosts:
    """``count`` hosts (0 .. count-1) on one switch; see the module docstring.  ``root``: a folder for
    the hosts' logs (``host-<i>-<what>.log``)."""

    def __init__(self, count: int, root: Path) -> None:
        self.count, self.root = count, Path(root)
        self.prefix = f"e31{uuid.uuid4().hex[:6]}"
        self.switch = f"{self.prefix}-sw"
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def namespace(self, i: int) -> str:
        """Host ``i``'s network namespace name."""
        return f"{self.prefix}-h{i}"

    def address(self, i: int) -> str:
        """Host ``i``'s address (``10.231.0.<i+1>``)."""
        return f"{SUBNET}.{i + 1}"

    def up(self) -> Hosts:
        """Make the switch and the hosts. Raises RuntimeError naming the ``ip`` command that failed."""
        self.root.mkdir(parents=True, exist_ok=True)
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.count):
            ns = self.namespace(i)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"port{i}", "netns", self.switch)
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"port{i}", "up")
        return self

    def popen(self, i: int, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
              log: str = "proc") -> subprocess.Popen:
        """Start ``argv`` on host ``i`` in a session of its own, output to ``host-<i>-<log>.log``."""
        with open(self.root / f"host-{i}-{log}.log", "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(i), *argv], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, i: int, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``argv`` on host ``i`` to its end (text output captured)."""
        return subprocess.run(["ip", "netns", "exec", self.namespace(i), *argv], capture_output=True, text=True,
                              env=env, cwd=cwd, timeout=timeout)

    def call(self, i: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a new thread on host ``i``'s network (:func:`in_netns`); its result, or the
        exception it raised."""
        box: dict[str, Any] = {}

        def body() -> None:
            try:
                with in_netns(self.namespace(i)):
                    box["value"] = fn(*args)
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=body, name=f"host-{i}")
        thread.start()
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def wait_for(self, i: int, probe: Callable[[], bool], timeout: float, what: str,
                 alive: subprocess.Popen | None = None) -> None:
        """Poll ``probe()`` on host ``i``'s network every 0.25 s until it is true.  Raises RuntimeError
        after ``timeout`` seconds, or at once when ``alive`` (the process that should answer) exits."""
        deadline = time.monotonic() + timeout
        while not self.call(i, probe):
            if alive is not None and alive.poll() is not None:
                raise RuntimeError(f"{what}: its process exited with {alive.returncode}; logs in {self.root}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not ready after {timeout:.0f} s; logs in {self.root}")
            time.sleep(0.25)

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down at the switch: it reaches no other host and none reaches it."""
        _ip("-n", self.switch, "link", "set", f"port{i}", "down")

    def restore(self, i: int) -> None:
        """Bring host ``i``'s link back up."""
        _ip("-n", self.switch, "link", "set", f"port{i}", "up")

    def stop(self, proc: subprocess.Popen, timeout: float = 20) -> None:
        """SIGTERM ``proc``'s session, SIGKILL after ``timeout`` seconds."""
        stop_group(proc, timeout)

    def down(self) -> None:
        """Kill every process left in the hosts' namespaces and delete the namespaces."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for ns in reversed(self._made):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._made.clear()

    def __enter__(self) -> Hosts:
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc: object) -> None:
        self.down()
