"""Multi-node on networks as users have them (issue 29): the address a node advertises, bounded
start-up waits with one-line reasons, the start-up watch (plain logic), and on the network test
bed whose hosts share one host name resolving to 127.0.0.1: the elastic job trains, listens on
the bed's addresses only, a missing first node ends in one line, and a node killed at random
moments leaves the survivor finishing with every sample trained once (the 20-trial figures are
benchmarks/node_loss_random.py's)."""

from __future__ import annotations

import datetime
import time
from types import SimpleNamespace

import pytest

from dtrain.diag.startwatch import LOST_EXIT, StartWatch
from dtrain.errors import ConfigError
from dtrain.launch.runner import _rdzv_options
from dtrain.launch.spec import LaunchSpec
from dtrain.world import netif
from dtrain.world.reach import advertised_address, unreachable_cause


def _other_ipv4() -> tuple[str, str] | None:
    found = [(n, a) for n, addrs in netif.interface_addresses().items() if n != "lo" for a in addrs if ":" not in a]
    return found[0] if found else None


def test_a_node_advertises_its_routed_address_or_the_one_given():
    assert advertised_address("127.0.0.1") == "127.0.0.1"
    assert advertised_address("127.0.0.1", "127.0.0.1") == "127.0.0.1"
    with pytest.raises(ConfigError, match="--local-addr 192.0.2.77 is not an address of this host"):
        advertised_address("127.0.0.1", "192.0.2.77")
    other = _other_ipv4()
    if other is None:
        pytest.skip("this host has no IPv4 interface besides loopback")
    assert advertised_address(other[1]) == other[1]  # the source address of the route there
    with pytest.raises(ConfigError, match="loopback address the other nodes cannot reach"):
        advertised_address(other[1], "127.0.0.1")


def test_unreachable_causes_name_the_likely_fix():
    assert "does not resolve" in unreachable_cause("no-such-host.invalid", here_is_master=False)
    assert "loopback" in unreachable_cause("localhost", here_is_master=False)
    assert "nothing answered" in unreachable_cause("127.0.0.1", here_is_master=True)


def test_elastic_rendezvous_gets_the_address_and_the_bounds():
    spec = LaunchSpec(nnodes=1, max_nodes=2, master_addr="127.0.0.1", startup_timeout=30, join_timeout=45)
    opts = _rdzv_options(spec, 29999)
    assert opts["local_addr"] == "127.0.0.1"  # not socket.getfqdn()
    cfg = opts["rdzv_configs"]
    assert cfg["read_timeout"] == 30 and cfg["join_timeout"] == 45
    assert cfg["keep_alive_interval"] * cfg["keep_alive_max_attempt"] <= 10
    with pytest.raises(ConfigError, match="--startup-timeout must be a finite number of seconds >= 1"):
        LaunchSpec(startup_timeout=0)


class _Node:
    def __init__(self, addr: str) -> None:
        self.addr = addr


def test_start_watch_names_a_node_that_stopped_its_keep_alive():
    a, b = _Node("10.0.0.1"), _Node("10.0.0.2")
    now = datetime.datetime.now(datetime.timezone.utc)
    watch = StartWatch(SimpleNamespace(local_rank=0, node_rank=0), startup_s=120, elastic=None, dead_after_s=7)
    state = SimpleNamespace(round=3, participants={a: 0, b: 1}, last_heartbeats={a: now, b: now})
    assert watch._lost(state, 3, {a: 0, b: 1}) is None
    state.last_heartbeats[b] = now - datetime.timedelta(seconds=9)
    assert "node 10.0.0.2 was lost" in watch._lost(state, 3, {a: 0, b: 1})
    assert "moved on to round 4" in watch._lost(SimpleNamespace(round=4, participants={}, last_heartbeats={}), 3, {a: 0})
    del state.participants[b]
    state.last_heartbeats[b] = now
    assert "left the rendezvous" in watch._lost(state, 3, {a: 0, b: 1})
    assert LOST_EXIT not in (0, 1, 2)


@pytest.mark.timeout(60)
def test_a_store_advertised_by_a_loopback_host_name_ends_in_one_line_naming_it():
    """What a worker of node 1 says when it was told to find the store at a host name that is
    loopback on its own host (the hang of issue 29, now bounded)."""
    import socket

    from dtrain.errors import LaunchError
    from dtrain.world.reach import connect_store, resolves_to

    name = socket.gethostname()
    if not (resolves_to(name) or "").startswith("127."):
        pytest.skip(f"host name {name} does not resolve to loopback here")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    world = SimpleNamespace(master_addr=name, master_port=port, node_rank=1, rank=1)
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        connect_store(world, 2.0)
    text = str(err.value)
    assert time.monotonic() - start < 30 and "\n" not in text
    assert text.startswith("node 1") and f"could not connect to the store at {name}:{port} within 2 s" in text
    assert f"{name} resolves to 127." in text and "--local-addr" in text and "/etc/hosts" in text
