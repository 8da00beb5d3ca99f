"""The command line as a user meets it: launchers, the ready job, and one clear line for bad input."""

from __future__ import annotations

import pytest


def test_rendezvous_listens_on_loopback_only():
    psutil = pytest.importorskip("psutil")
    from dtrain.launch.store import host_store

    store, port = host_store("127.0.0.1", 0)
    try:
        listening = [c for c in psutil.Process().net_connections(kind="tcp") if c.status == "LISTEN" and c.laddr.port == port]
        assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening)
    finally:
        del store
