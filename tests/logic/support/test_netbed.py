"""Between hosts: the socket interface chosen for the master address (tier 1), and a real
two-host run over the network test bed (two namespaces, veth, tbf), skipped where the bed cannot
be built (needs root and `ip netns`)."""

from __future__ import annotations

import os

import pytest

from dtrain.errors import ConfigError
from dtrain.world import netif


def test_loopback_master_gets_the_loopback_interface():
    lo = netif.loopback_interface()
    assert lo is not None
    assert netif.socket_env("127.0.0.1", {}) == {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}
    assert netif.socket_env("localhost", {"GLOO_SOCKET_IFNAME": "mine"}) == {"NCCL_SOCKET_IFNAME": lo}
    assert netif.route_interface("127.0.0.1") == ("lo", "127.0.0.1")


def test_interface_that_routes_to_the_master_unless_the_user_chose_one():
    # Any non-loopback IPv4 address of this host routes through its own interface.
    found = [(n, a) for n, addrs in netif.interface_addresses().items() if n != "lo" for a in addrs if ":" not in a]
    if not found:
        pytest.skip("this host has no IPv4 interface besides loopback")
    name, addr = found[0]
    assert netif.socket_env(addr, {}) == {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}
    assert netif.socket_env(addr, {"GLOO_SOCKET_IFNAME": "mine"}) == {"NCCL_SOCKET_IFNAME": name}
    assert netif.socket_env(addr, {"GLOO_SOCKET_IFNAME": "a", "NCCL_SOCKET_IFNAME": "b"}) == {}


def test_an_interface_setting_that_cannot_work_is_named_before_the_job_waits_for_it(monkeypatch):
    """The user's GLOO/NCCL_SOCKET_IFNAME: an interface this host lacks, or loopback where the
    master is another host (before, a rank waited out its start-up timeout, 95-120 s on the bed)."""
    lo = netif.loopback_interface()
    other = "192.0.2.1"  # TEST-NET-1: another host; nothing is sent
    assert netif.user_interface_problem(other, {}) is None
    assert netif.user_interface_problem(other, {"GLOO_SOCKET_IFNAME": lo}).startswith(
        f"GLOO_SOCKET_IFNAME={lo} is the loopback interface, but the nodes meet at {other}")
    assert netif.user_interface_problem(other, {"NCCL_SOCKET_IFNAME": f"={lo}"}).startswith(
        f"NCCL_SOCKET_IFNAME=={lo} is the loopback interface")
    assert netif.user_interface_problem("127.0.0.1", {"GLOO_SOCKET_IFNAME": lo}) is None  # one host: loopback is right
    assert netif.user_interface_problem("localhost", {"NCCL_SOCKET_IFNAME": lo}) is None
    missing = netif.user_interface_problem("127.0.0.1", {"GLOO_SOCKET_IFNAME": f"{lo},nosuch9"})
    assert missing.startswith(f"GLOO_SOCKET_IFNAME={lo},nosuch9 names no interface of this host (it has: ") and lo in missing
    assert netif.user_interface_problem(other, {"NCCL_SOCKET_IFNAME": "^docker"}) is None  # exclusions: not judged
    # only the variable the job's backend reads: a CPU job leaves NCCL's alone, and the other way round
    assert netif.user_interface_problem(other, {"NCCL_SOCKET_IFNAME": lo}, ["GLOO_SOCKET_IFNAME"]) is None
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch9")
    with pytest.raises(ConfigError, match="GLOO_SOCKET_IFNAME=nosuch9 names no interface"):
        netif.use_route_interface("127.0.0.1", quiet=True, backend="gloo")
    assert netif.use_route_interface("127.0.0.1", quiet=True, backend="nccl") == {"NCCL_SOCKET_IFNAME": lo}
    os.environ.pop("NCCL_SOCKET_IFNAME")  # set by the call above (not through monkeypatch)
    assert netif.use_route_interface("127.0.0.1", quiet=True) == {"NCCL_SOCKET_IFNAME": lo}  # backend unknown: not judged
    os.environ.pop("NCCL_SOCKET_IFNAME")


def test_unresolvable_master_leaves_the_choice_to_gloo():
    assert netif.socket_env("no-such-host.invalid", {}) == {}
