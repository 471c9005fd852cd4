"""Where the ranks of a run meet: the rendezvous ``torch.distributed`` and ``torchrun`` expect.

Every run's work is told where its ranks meet, also when it has one rank (a single-node job), so a
work written for a gang runs unchanged on one node:

======================  =============================  ==========================================
variable                E31's own name                 value
======================  =============================  ==========================================
``MASTER_ADDR``         ``E31_MASTER_ADDR``            the lead node's address (:func:`own_address`)
``MASTER_PORT``         ``E31_MASTER_PORT``            a free TCP port there (:func:`free_port`)
``WORLD_SIZE``          ``E31_WORLD_SIZE``             the ranks: one per node
``RANK``                ``E31_RANK``                   this node's rank, 0 on the lead
``LOCAL_RANK``          ``E31_LOCAL_RANK``             0: one process per node
``NODE_RANK``           ``E31_NODE_RANK``              = ``RANK``
``NNODES``              ``E31_NNODES``                 the nodes of the job (``request.nodes``)
======================  =============================  ==========================================

These are the names of torch's ``env://`` initialisation (``MASTER_ADDR``, ``MASTER_PORT``,
``WORLD_SIZE``, ``RANK``) and of the per-worker variables ``torchrun`` sets (``LOCAL_RANK``), so
``torch.distributed.init_process_group(backend)`` needs no argument.  A ``command:`` job that runs
``torchrun`` itself (several processes per node) passes the ``E31_*`` names on, which nothing else
overwrites: ``torchrun --nnodes $E31_NNODES --node-rank $E31_NODE_RANK --master-addr
$E31_MASTER_ADDR --master-port $E31_MASTER_PORT --nproc-per-node 8 train.py``; torchrun then sets
the torch names of each process it starts.

The port: ``E31_RENDEZVOUS_PORTS`` on a worker (``29500-29599``, or one port) limits it to a range a
cluster's firewall opens; the first port of the range free on the address is taken.  Without it, the
kernel picks a free one.  A port is free when this process can bind it; the work binds it moments
later, so another program may take it in between (then torch's store fails to start and says so).
No Prefect, no torch here.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["ADDRESS_VAR", "PORTS_VAR", "Rendezvous", "RendezvousError", "free_port", "interface_of", "own_address",
           "port_range"]

#: A node's address for its peers, set on its worker when the guess of :func:`own_address` is wrong
#: (several interfaces, a network for the ranks apart from the one to the Prefect server).
ADDRESS_VAR = "E31_ADDRESS"
#: The ports a rank's store may listen on: ``LOW-HIGH`` or one port (unset: any free port).
PORTS_VAR = "E31_RENDEZVOUS_PORTS"


class RendezvousError(RuntimeError):
    """No address or port for the ranks to meet at: the message names the setting and its fix."""


@dataclass(frozen=True)
class Rendezvous:
    """Where a run's ranks meet, and which one this process is.

    ``master_addr``: the lead node's address (IPv4 or IPv6 text, or a host name);
    ``master_port``: its TCP port (1-65535); ``node_rank``: 0 .. ``nnodes`` - 1, 0 on the lead;
    ``nnodes``: the nodes of the job, one rank each; ``interface``: the network interface this rank's
    peers reach it on (None: not known).
    """

    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    node_rank: int = 0
    nnodes: int = 1
    interface: str | None = None

    def __post_init__(self) -> None:
        # a rank outside the world, or a port no socket can have, would hang every peer in its
        # first collective rather than fail at once
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is not within the {self.nnodes} nodes")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port {self.master_port} is not a TCP port")

    @property
    def is_lead(self) -> bool:
        """True on rank 0: the node whose flow process stages, supervises and returns the output."""
        return self.node_rank == 0

    def environment(self) -> dict[str, str]:
        """The variables of the table above, torch's names and E31's, as strings."""
        values = {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
                  "WORLD_SIZE": str(self.nnodes), "RANK": str(self.node_rank), "LOCAL_RANK": "0",
                  "NODE_RANK": str(self.node_rank), "NNODES": str(self.nnodes)}
        env = {**values, **{"E31_" + name: value for name, value in values.items()}}
        if self.interface:
            # gloo and NCCL advertise the address their host name resolves to (often a loopback one, which
            # a peer on another host cannot reach) unless told the interface; one set on the worker wins
            for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                env[name] = os.environ.get(name) or self.interface
        return env


def port_range(text: str | None) -> range | None:
    """The ports of an ``E31_RENDEZVOUS_PORTS`` value: ``"29500-29599"`` -> ``range(29500, 29600)``,
    ``"29500"`` -> one port; None or blank -> None (any free port).  Raises :class:`RendezvousError`
    naming the variable for anything else (not numbers, low above high, outside 1-65535)."""
    if text is None or not text.strip():
        return None
    low, sep, high = text.strip().partition("-")
    try:
        first, last = int(low), int(high if sep else low)
    except ValueError:
        first = last = -1
    if not 0 < first <= last < 65536:
        raise RendezvousError(f"{PORTS_VAR}={text!r}: not a port or a range of ports; set it like 29500-29599 "
                              "(ports the nodes may reach each other on), or unset it to use any free port")
    return range(first, last + 1)


def free_port(address: str, ports: range | None = None) -> int:
    """A TCP port that can be bound on ``address`` now: the first free one of ``ports``, or one the
    kernel picks when ``ports`` is None.  Raises :class:`RendezvousError` when every port of
    ``ports`` is taken, naming the range and the variable that sets it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    for port in ports if ports is not None else (0,):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    assert ports is not None  # port 0 always binds on an address of this host
    raise RendezvousError(f"no free port for the ranks to meet at on {address}: every port of {PORTS_VAR}="
                          f"{ports.start}-{ports.stop - 1} is taken; widen the range or stop what holds them")


def own_address(api_url: str | None = None) -> str:
    """This node's address for its peers: ``E31_ADDRESS`` when set, else the address this host
    reaches the Prefect API from (``api_url``; the route the kernel would take: no packet is sent),
    else 127.0.0.1.  A loopback API (one machine) gives the loopback address; a host name that does
    not resolve gives 127.0.0.1 too."""
    chosen = os.environ.get(ADDRESS_VAR, "").strip()
    if chosen:
        return chosen
    host = urlsplit(api_url).hostname if api_url else None
    if not host:
        return "127.0.0.1"
    try:
        info = socket.getaddrinfo(host, 80, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as sock:
            sock.connect(info[4])  # a UDP connect only picks the route and the source address
            found = sock.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    return found


def interface_of(address: str) -> str | None:
    """The name of this host's network interface holding the IPv4 ``address`` (``eth0``), or None (not
    an IPv4 address of this host, or not Linux).  Reads each interface's address with the
    ``SIOCGIFADDR`` ioctl (Linux), the way ``ip addr`` finds it."""
    import fcntl
    import struct

    try:
        wanted = socket.inet_aton(address)
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                answer = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
            if answer[20:24] == wanted:
                return name
    return None
