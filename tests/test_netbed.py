"""Between hosts: the socket interface chosen for the master address (tier 1), and a real
two-host run over the network test bed (two namespaces, veth, tbf), skipped where the bed cannot
be built (needs root and `ip netns`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dtrain import netif
from dtrain.testing import netbed

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


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


def test_unresolvable_master_leaves_the_choice_to_gloo():
    assert netif.socket_env("no-such-host.invalid", {}) == {}


_REASON = netbed.unavailable_reason()
needs_bed = pytest.mark.skipif(_REASON is not None, reason=f"network test bed unavailable: {_REASON}")


@needs_bed
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_hosts_train_over_a_shaped_link():
    pytest.importorskip("sklearn")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}
    with netbed.NetBed(rate_mbit=100) as bed:
        namespaces = bed.namespaces
        assert all(ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout for ns in namespaces)
        outs = bed.run_nodes(lambda rank, master: [
            sys.executable, "-m", "dtrain", "train", "--task", "digits", "--max-steps", "40", "--comm", "fp16",
            "--nnodes", "2", "--node-rank", str(rank), "--master-addr", master, "--master-port", "29517"], timeout=160, env=env)
    assert [o.returncode for o in outs] == [0, 0], "\n".join(o.output[-3000:] for o in outs)
    result = json.loads(next(line for line in reversed(outs[0].output.splitlines()) if line.startswith("{")))
    assert result["world_size"] == 2 and result["steps"] == 40 and result["comm"] == "fp16"
    assert "GLOO_SOCKET_IFNAME=" in outs[0].output  # the veth, not the host name's 127.0.0.1
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in left for ns in namespaces), "the bed was not removed"


@needs_bed
@pytest.mark.timeout(60)
def test_bed_is_removed_when_interrupted():
    script = ("import os, signal, sys, time\n"
              "from dtrain.testing.netbed import NetBed\n"
              "with NetBed(rate_mbit=10) as bed:\n"
              "    print(' '.join(bed.namespaces), flush=True)\n"
              "    bed.popen(1, ['sleep', '60'])\n"
              "    time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    namespaces = proc.stdout.readline().split()
    assert len(namespaces) == 2, proc.stderr.read()
    proc.send_signal(15)
    proc.wait(timeout=30)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in left for ns in namespaces), left


@needs_bed
def test_delay_without_netem_says_so():
    with netbed.NetBed() as bed:
        has_netem = bed.netem
    if has_netem:
        pytest.skip("this kernel has netem")
    with pytest.raises(netbed.NetBedUnavailable, match="no netem qdisc"):
        with netbed.NetBed(rate_mbit=100, delay_ms=5):
            pass
