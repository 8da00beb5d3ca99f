"""`dtrain doctor` on a node other than 0 waits for node 0's port within --timeout, as the launcher
does (nodes start in any order), saying that it waits, and fails its port check only after that.
Two nodes' doctors as subprocesses, node 1 first: tests/multiprocess/diag/test_diag.py."""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest

from dtrain.cli.doctor_checks import DoctorConfig, check_port
from dtrain.launch import preflight


@pytest.fixture
def closed_port():
    """A port bound but not listening yet (a connection is refused), and a way to open it later."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    opener: list[threading.Timer] = []

    def listen_after(delay_s: float) -> None:
        opener.append(threading.Timer(delay_s, sock.listen, (8,)))
        opener[0].start()

    yield sock.getsockname()[1], listen_after
    for timer in opener:
        timer.cancel()
        timer.join()
    sock.close()


def _node1(port: int, timeout_s: float) -> DoctorConfig:
    return DoctorConfig(nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=port, probe=False, timeout_s=timeout_s)


@pytest.mark.timeout(60)
def test_node_1_started_first_waits_for_node_0_and_says_so(closed_port, monkeypatch):
    monkeypatch.setattr(preflight, "FIRST_NOTE_S", 0.3)
    port, listen_after = closed_port
    listen_after(1.5)  # node 0's doctor comes up after node 1's
    said: list[str] = []
    check = check_port(_node1(port, 30.0), said.append)
    assert (check.status, check.detail) == ("PASS", f"127.0.0.1:{port} accepts connections"), check
    assert said and re.match(rf"WAIT\s+port\s+node 1: waiting for node 0 at 127.0.0.1:{port} \(\d+ s of 30 s\): connection "
                             r"refused \(nothing listens there\); node 0's doctor has not started yet", said[0]), said


@pytest.mark.timeout(60)
def test_node_1_fails_its_port_check_with_the_fix_only_after_its_timeout(closed_port):
    port, _ = closed_port
    start = time.monotonic()
    check = check_port(_node1(port, 1.5), lambda line: None)
    assert time.monotonic() - start >= 1.5
    assert check.status == "FAIL"
    assert check.detail == (f"node 1 could not connect to node 0 at 127.0.0.1:{port} within 1.5 s: connection refused "
                            "(nothing listens there)")
    assert check.fix == ("start `dtrain doctor --node-rank 0` on node 0 with the same --master-addr and --master-port, "
                         "or raise --timeout")


@pytest.mark.timeout(60)
def test_the_doctor_prints_the_wait_then_the_failed_port_check(closed_port, monkeypatch, capsys):
    from dtrain.cli import main

    monkeypatch.setattr(preflight, "FIRST_NOTE_S", 0.3)
    port, _ = closed_port
    code = main(["doctor", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                 "--no-probe", "--timeout", "1.5"])
    out = capsys.readouterr().out
    assert code == 1, out
    wait = re.search(r"^WAIT\s+port\s+node 1: waiting for node 0 ", out, re.M)
    fail = re.search(rf"^FAIL\s+port\s+node 1 could not connect to node 0 at 127.0.0.1:{port} within 1.5 s: connection "
                     r"refused \(nothing listens there\)  -> fix: start `dtrain doctor --node-rank 0` on node 0", out, re.M)
    assert wait and fail and wait.start() < fail.start(), out
    assert re.search(r"^FAIL\s+network\s+.*loopback.*-> fix:", out, re.M), out  # 127.0.0.1 across nodes
    assert "rendezvous" not in out and re.search(r"checks: \d+ failed \(network, port\)", out), out
