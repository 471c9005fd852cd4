"""Where a run's ranks meet: the variables every work gets, the port and the address chosen."""

from __future__ import annotations

import socket

import pytest

from e31.tasks import settings
from e31.tasks.work.context import ChildConfig, WorkContext, command_environment
from e31.tasks.work.rendezvous import Rendezvous, RendezvousError, free_port, own_address, port_range
from tests.hosts import Hosts, unavailable


def _config(tmp_path, **rendezvous) -> ChildConfig:
    return ChildConfig(entrypoint="m:f", command=None, params={}, data={}, output_dir=str(tmp_path / "out"),
                       checkpoint_dir=str(tmp_path / "ck"), progress_file=str(tmp_path / "progress.json"),
                       device="cpu", cpus=1, gpus=0, **rendezvous)


def test_a_single_node_run_is_rank_0_of_1_meeting_on_a_free_loopback_port(tmp_path):
    env = command_environment(_config(tmp_path))
    port = int(env["MASTER_PORT"])
    assert {k: env[k] for k in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "NNODES")} == {
        "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "NODE_RANK": "0", "NNODES": "1"}
    assert {k[4:]: v for k, v in env.items() if k.startswith("E31_") and k[4:] in (
        "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "NNODES")} == {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
        "NODE_RANK": "0", "NNODES": "1"}
    with socket.socket() as sock:  # the port chosen is one the work can bind
        sock.bind(("127.0.0.1", port))


def test_a_member_node_is_told_its_rank_and_the_leads_address(tmp_path):
    cfg = _config(tmp_path, master_addr="10.231.0.2", master_port=29511, node_rank=2, nnodes=3)
    env = command_environment(cfg)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (
        "10.231.0.2", "29511", "2", "3", "0")
    assert (env["E31_NODE_RANK"], env["E31_NNODES"]) == ("2", "3")
    ctx = WorkContext(cfg)
    assert (ctx.rank, ctx.world_size, ctx.is_lead) == (2, 3, False)
    assert (WorkContext(_config(tmp_path)).rank, WorkContext(_config(tmp_path)).is_lead) == (0, True)


def test_a_rank_outside_the_world_is_refused_before_any_peer_waits_on_it():
    with pytest.raises(ValueError, match="^node_rank 3 is not within the 3 nodes$"):
        Rendezvous("10.0.0.1", 29500, 3, 3)


def test_the_port_range_variable_is_read_and_a_bad_one_named_with_its_fix(monkeypatch):
    assert port_range("29500-29502") == range(29500, 29503)
    assert port_range(" 29500 ") == range(29500, 29501)
    assert port_range(None) is None and port_range("") is None
    monkeypatch.setenv("E31_RENDEZVOUS_PORTS", "29600-29500")
    with pytest.raises(settings.SettingsError) as err:
        settings.check()
    assert str(err.value) == ("E31_RENDEZVOUS_PORTS='29600-29500': not a port or a range of ports; set it like "
                              "29500-29599 (ports the nodes may reach each other on), or unset it to use any free port")


def test_a_taken_port_of_the_range_is_passed_over_and_a_full_range_says_so():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = range(taken, min(taken + 50, 65536))
        got = free_port("127.0.0.1", ports)
        assert got in ports and got > taken
        with pytest.raises(RendezvousError) as err:
            free_port("127.0.0.1", range(taken, taken + 1))
        assert str(err.value) == (f"no free port for the ranks to meet at on 127.0.0.1: every port of "
                                  f"E31_RENDEZVOUS_PORTS={taken}-{taken} is taken; widen the range or stop what "
                                  "holds them")


def test_a_gang_takes_its_port_within_the_range_a_single_node_run_takes_any(tmp_path, monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setenv("E31_RENDEZVOUS_PORTS", str(taken))
        assert _config(tmp_path).rendezvous().master_port != taken  # one node's ranks meet on loopback
        with pytest.raises(RendezvousError, match=f"every port of E31_RENDEZVOUS_PORTS={taken}-{taken} is taken"):
            _config(tmp_path, nnodes=2).rendezvous()


def test_the_address_is_the_one_set_else_the_one_toward_the_api(monkeypatch):
    monkeypatch.setenv("E31_ADDRESS", "10.9.8.7")
    assert own_address("http://127.0.0.1:4200/api") == "10.9.8.7"
    monkeypatch.delenv("E31_ADDRESS")
    assert own_address("http://127.0.0.1:4200/api") == "127.0.0.1"
    assert own_address(None) == "127.0.0.1"
    assert own_address("http://no-such-host.invalid:4200/api") == "127.0.0.1"


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_on_a_host_of_its_own_the_address_is_the_one_its_peers_reach(tmp_path, monkeypatch):
    monkeypatch.delenv("E31_ADDRESS", raising=False)
    with Hosts(3, root=tmp_path) as hosts:
        assert hosts.call(2, own_address, f"http://{hosts.address(0)}:4200/api") == hosts.address(2) == "10.231.0.3"


def test_the_interface_of_an_address_is_named_for_gloo_and_nccl(tmp_path, monkeypatch):
    from e31.tasks.work.rendezvous import interface_of

    assert interface_of("127.0.0.1") == "lo" and interface_of("192.0.2.77") is None
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    env = command_environment(_config(tmp_path, master_addr="10.231.0.2", master_port=29500, nnodes=2,
                                      interface="eth0"))
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("eth0", "eth0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")  # one the worker sets wins
    assert command_environment(_config(tmp_path, interface="eth0"))["GLOO_SOCKET_IFNAME"] == "ib0"
    assert "GLOO_SOCKET_IFNAME" not in command_environment(_config(tmp_path))


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_on_a_host_of_its_own_its_address_is_on_its_eth0(tmp_path):
    from e31.tasks.work.rendezvous import interface_of

    with Hosts(2, root=tmp_path) as hosts:
        assert hosts.call(1, interface_of, hosts.address(1)) == "eth0"
