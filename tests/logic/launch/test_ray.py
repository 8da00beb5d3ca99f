"""--launcher ray without a cluster: what the launch spec refuses, the address and capacity checks,
and what a worker's environment carries over from the driver. Against a real Ray head:
tests/multiprocess/launch/test_ray.py."""

from __future__ import annotations

import socket
import sys

import pytest

from dtrain.errors import ConfigError
from dtrain.launch import LaunchSpec
from dtrain.launch import ray as rl


@pytest.fixture
def ray_present(monkeypatch):
    """find_spec("ray") answers as where ray is installed (no import of ray happens in these checks)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "ray" else real(name, *a))


@pytest.mark.parametrize("given", [{"master_addr": "10.0.0.1"}, {"master_port": 29500}, {"node_rank": 1, "nnodes": 2},
                                   {"local_addr": "10.0.0.2"}])
def test_ray_places_the_nodes_so_node_flags_are_refused(ray_present, given):
    with pytest.raises(ConfigError, match="do not go with --launcher ray"):
        LaunchSpec(launcher="ray", nproc=2, **given)


def test_elastic_nodes_and_a_ray_address_without_ray_are_refused(ray_present):
    with pytest.raises(ConfigError, match="--nnodes MIN:MAX needs --launcher torchrun"):
        LaunchSpec(launcher="ray", nnodes=1, max_nodes=2, master_addr="10.0.0.1")
    with pytest.raises(ConfigError, match=r"^--ray-address 10.0.0.1:6379 needs --launcher ray\.$"):
        LaunchSpec(nproc=2, ray_address="10.0.0.1:6379")


def test_a_ray_job_of_one_worker_still_launches_on_the_cluster(ray_present):
    spec = LaunchSpec(launcher="ray", nproc=1, nnodes=2)  # several nodes need no --master-addr under Ray
    assert spec.needs_launch and spec.world_size == 2
    assert LaunchSpec(launcher="ray").needs_launch
    assert not LaunchSpec().needs_launch


def test_without_ray_installed_the_spec_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as where ray is not installed: find_spec None, import fails
    with pytest.raises(ConfigError, match=r"needs the ray package, which is not installed here; pip install 'dtrain\[ray\]'"):
        LaunchSpec(launcher="ray", nproc=2)
    with pytest.raises(ConfigError, match="pip install 'dtrain"):
        rl.import_ray()


@pytest.mark.parametrize("address", ["nonsense", "10.0.0.1", "host:port"])
def test_an_address_that_is_not_host_port_is_refused(address):
    with pytest.raises(ConfigError, match=f"--ray-address {address} is not HOST:PORT"):
        rl._check_reachable(address)


def test_nobody_listening_at_the_address_is_refused_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: a connect is refused
        with pytest.raises(ConfigError, match=f"no Ray cluster reachable at --ray-address 127.0.0.1:{port}"):
            rl._check_reachable(f"127.0.0.1:{port}")
    for address in ("auto", "local", "ray://10.0.0.1:10001"):
        rl._check_reachable(address)  # Ray's own discovery / client: nothing to probe here


def test_a_refused_remote_address_names_a_head_listening_on_loopback_only(monkeypatch):
    # A head on a host whose name resolves to 127.0.0.1 registers 127.0.0.1 and refuses the other hosts.
    def refused(address, timeout=None):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(rl.socket, "create_connection", refused)
    with pytest.raises(ConfigError) as info:
        rl._check_reachable("10.0.0.1:6379")
    assert str(info.value) == (
        "no Ray cluster reachable at --ray-address 10.0.0.1:6379 (Connection refused); start its head (`ray start --head "
        "--port 6379`) or give the address `ray start --head` printed (a head that printed 'Local node IP: 127.0.0.1' "
        "listens on loopback only: start it with `ray start --head --node-ip-address 10.0.0.1`).")


class _FakeRay:
    def __init__(self, *nodes: dict[str, float]) -> None:
        self._nodes = [{"Alive": True, "Resources": r} for r in nodes] + [{"Alive": False, "Resources": {"CPU": 64.0}}]

    def nodes(self) -> list[dict]:
        return self._nodes


def test_capacity_is_judged_per_node_and_a_dead_node_does_not_count(ray_present):
    ray = _FakeRay({"CPU": 4.0}, {"CPU": 2.0})
    rl._check_capacity(ray, LaunchSpec(launcher="ray", nproc=4), {"CPU": 4.0})  # the first node holds all 4
    rl._check_capacity(ray, LaunchSpec(launcher="ray", nproc=2, nnodes=2), {"CPU": 2.0})  # 2 on each of the 2 nodes
    with pytest.raises(ConfigError, match=r"it has 2 node\(s\) with 4, 2 CPU\(s\) each; use -n 4 or fewer"):
        rl._check_capacity(ray, LaunchSpec(launcher="ray", nproc=6), {"CPU": 6.0})
    with pytest.raises(ConfigError, match=r"use --nnodes 1 or a smaller -n"):
        rl._check_capacity(ray, LaunchSpec(launcher="ray", nproc=3, nnodes=2), {"CPU": 3.0})


def test_gpu_bundles_are_judged_on_gpus(ray_present):
    ray = _FakeRay({"CPU": 32.0, "GPU": 2.0})
    with pytest.raises(ConfigError, match=r"\(4 CPU\(s\) and 4 GPU\(s\) per node\): it has 1 node\(s\) with 2 GPU\(s\) each; use -n 2"):
        rl._check_capacity(ray, LaunchSpec(launcher="ray", nproc=4), {"CPU": 4.0, "GPU": 4.0})


def test_workers_get_the_run_options_but_not_the_drivers_launch_link(monkeypatch):
    monkeypatch.setenv("DTRAIN_STALL_TIMEOUT", "30")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("PYTHONPATH", "/src")
    monkeypatch.setenv("DTRAIN_LAUNCHER_PID", "123")
    monkeypatch.setenv("DTRAIN_LAUNCH_DIR", "/tmp/x")
    monkeypatch.setenv("HOME_ONLY_HERE", "1")
    env = rl._forwarded_env()
    assert env["DTRAIN_STALL_TIMEOUT"] == "30" and env["NCCL_DEBUG"] == "INFO" and env["PYTHONPATH"] == "/src"
    assert "DTRAIN_LAUNCHER_PID" not in env and "DTRAIN_LAUNCH_DIR" not in env and "HOME_ONLY_HERE" not in env
