"""The launcher's life cycle: workers die with it, stop signals end a job promptly and quietly,
a worker's error reaches the user once, and a one-node run listens on loopback only."""

from __future__ import annotations

import os

import psutil

from dtrain.launch.supervise import Supervisor


def test_doctor_hosts_its_store_on_loopback_only():
    from dtrain.cli.doctor_checks import DoctorConfig, check_rendezvous

    check, store, _ = check_rendezvous(DoctorConfig(probe=False, timeout_s=10))
    try:
        assert check.status == "PASS", check
        mine = [c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
    finally:
        del store
    assert mine and all(a.ip == "127.0.0.1" for a in mine), mine


def test_signals_reach_only_this_launchs_workers(tmp_path):
    """A pid file naming a process that is not a worker of this launch (a reused pid: here the
    test process itself) is never signalled."""
    with Supervisor() as sup:
        (tmp_path / "x").touch()
        with open(os.path.join(sup.dir, f"pid-{os.getpid()}"), "w") as f:
            f.write("0")
        assert sup.workers() == []
    assert not os.path.exists(sup.dir)
