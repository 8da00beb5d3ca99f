"""Multi-node on networks as users have them (issue 29): the address a node advertises, bounded
start-up waits with one-line reasons, the start-up watch (plain logic), and on the network test
bed whose hosts share one host name resolving to 127.0.0.1: the elastic job trains, listens on
the bed's addresses only, a missing first node ends in one line, and a node killed at random
moments leaves the survivor finishing with every sample trained once (the 20-trial figures are
benchmarks/node_loss_random.py's)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

import pytest

from tests.paths import ROOT
from tests.support import netbed, nodeloss


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


_REASON = netbed.unavailable_reason()
needs_bed = pytest.mark.skipif(_REASON is not None, reason=f"network test bed unavailable: {_REASON}")


@needs_bed
@pytest.mark.timeout(60)
def test_shared_name_bed_resolves_every_host_name_to_loopback():
    probe = "import socket; n = socket.gethostname(); print(n, socket.gethostbyname(n))"
    with netbed.NetBed(hosts=2, shared_name="vm") as bed:
        names = [bed.popen(h, [sys.executable, "-c", probe]).communicate(timeout=30)[0].split() for h in range(2)]
        hosts_file = open(f"/etc/netns/{bed.namespaces[1]}/hosts").read()
    assert names == [["vm", "127.0.0.1"], ["vm", "127.0.0.1"]]
    assert "10.77.0." not in hosts_file  # no host is named after its bed address
    with pytest.raises(ValueError, match="shared_name must be a host name"):
        netbed.NetBed(shared_name="bad name")


def _listeners(ns: str) -> set[str]:
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnH"], capture_output=True, text=True).stdout
    return {line.split()[3] for line in out.splitlines() if len(line.split()) > 3}


@needs_bed
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_elastic_job_on_hosts_whose_name_is_loopback_trains_and_listens_on_bed_addresses(tmp_path):
    """The job of issue 29 (which hung forever in init_process_group), on digits."""
    with netbed.NetBed(hosts=2, shared_name="vm") as bed:
        def cmd(rank, master):
            return [sys.executable, "-m", "dtrain", "train", "--task", "digits", "--max-steps", "40",
                    "--nnodes", "1:2", "--master-addr", master, "--master-port", "29712",
                    "--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "20",
                    "--ledger", str(tmp_path / "ledger"), "--startup-timeout", "60"]
        seen: set[str] = set()
        import threading

        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                for ns in bed.namespaces:
                    seen.update(_listeners(ns))
                time.sleep(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            outs = bed.run_nodes(cmd, timeout=150, env=_env())
        finally:
            done.set()
            watcher.join(5)
    assert [o.returncode for o in outs] == [0, 0], "\n".join(o.output[-3000:] for o in outs)
    result = json.loads(next(line for o in outs for line in reversed(o.output.splitlines()) if line.startswith("{")))
    assert result["world_size"] == 2 and result["steps"] == 40
    assert seen, "no listening socket was seen while the job ran"
    wide = sorted(a for a in seen if a.rsplit(":", 1)[0] in ("0.0.0.0", "*", "[::]"))
    assert not wide, f"listening on every interface: {wide} (all: {sorted(seen)})"


@needs_bed
@pytest.mark.timeout(120)
def test_the_doctor_probes_between_hosts_whose_name_is_loopback():
    """The doctor's all-reduce between the nodes (and `--links-out`) on hosts sharing one name that
    resolves to 127.0.0.1: its sockets on the interface that routes to the master, as a job's are
    (before, gloo announced 127.0.0.1: node 0 failed to connect and node 1 hung)."""
    port = 29714
    with netbed.NetBed(hosts=2, shared_name="vm") as bed, tempfile.TemporaryDirectory() as tmp:
        links = os.path.join(tmp, "links.json")

        def doctor(rank: int) -> subprocess.Popen:
            return bed.popen(rank, [sys.executable, "-m", "dtrain", "doctor", "--nnodes", "2", "--node-rank", str(rank),
                                    "--master-addr", bed.addresses[0], "--master-port", str(port), "--timeout", "30",
                                    "--links-out", links], env=_env())
        node0 = doctor(0)
        try:
            deadline = time.monotonic() + 60
            while not any(a.endswith(f":{port}") for a in _listeners(bed.namespaces[0])) and time.monotonic() < deadline:
                time.sleep(0.2)
            node1 = doctor(1)
            outs = [node1.communicate(timeout=100)[0], node0.communicate(timeout=100)[0]]
        finally:
            node0.kill()
        assert os.path.exists(links)
    for out in outs:
        assert "FAIL" not in out and re.search(r"^PASS\s+all-reduce\s+2 nodes \(gloo\): latency", out, re.M), out[-3000:]


@needs_bed
@pytest.mark.timeout(120)
def test_the_doctor_names_a_loopback_socket_interface_and_ends_its_probe_within_the_timeout():
    """GLOO_SOCKET_IFNAME=lo on both nodes: they meet in the store, then each announces 127.0.0.1.
    The network check names the setting; the probe ends within --timeout (+5 s): node 1 waited
    for gloo's own connect retries before, 100 s with --timeout 20."""
    port = 29715
    env = {**_env(), "GLOO_SOCKET_IFNAME": "lo"}
    with netbed.NetBed(hosts=2, shared_name="vm") as bed:
        def doctor(rank: int) -> subprocess.Popen:
            return bed.popen(rank, [sys.executable, "-m", "dtrain", "doctor", "--nnodes", "2", "--node-rank", str(rank),
                                    "--master-addr", bed.addresses[0], "--master-port", str(port), "--timeout", "10"], env=env)
        node0 = doctor(0)
        try:
            deadline = time.monotonic() + 60
            while not any(a.endswith(f":{port}") for a in _listeners(bed.namespaces[0])) and time.monotonic() < deadline:
                time.sleep(0.2)
            start = time.monotonic()
            node1 = doctor(1)
            outs = [node0.communicate(timeout=60)[0], node1.communicate(timeout=60)[0]]
            took = time.monotonic() - start
        finally:
            node0.kill()
    for proc, out in zip((node0, node1), outs):
        assert proc.returncode == 1, out[-3000:]
        assert re.search(r"^FAIL\s+network\s.*GLOO_SOCKET_IFNAME=lo is the loopback interface, but the nodes meet at 10\.77\.0\.1",
                         out, re.M), out[-3000:]
        assert re.search(r"^FAIL\s+all-reduce\s+2 nodes could not all-reduce", out, re.M), out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    # The node whose peer connects to its own loopback is refused at once; the other waits for it.
    assert any("no connection between the nodes within 10 s of their meeting in the store" in out for out in outs), outs[1][-3000:]
    assert took < 45, f"the doctors took {took:.0f} s with --timeout 10"


@needs_bed
@pytest.mark.timeout(120)
def test_a_first_node_nobody_can_reach_ends_in_one_line_within_the_bound():
    with netbed.NetBed(hosts=2, shared_name="vm") as bed, tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        proc = bed.popen(1, [sys.executable, "-m", "dtrain", "train", "--task", "digits", "--max-steps", "2",
                             "--nnodes", "1:2", "--master-addr", "10.77.0.9", "--master-port", "29713",
                             "--checkpoint-dir", os.path.join(tmp, "ck"), "--save-every", "1", "--startup-timeout", "5"],
                         env=_env())
        out = proc.communicate(timeout=100)[0]
        took = time.monotonic() - start
    last = out.strip().splitlines()[-1]
    assert proc.returncode not in (0, None), out[-3000:]
    assert last.startswith("dtrain: error: node 10.77.0.2 could not connect to the rendezvous store at 10.77.0.9:29713 "
                           "within 5 s"), out[-3000:]
    assert "Traceback" not in out and took < 90


@needs_bed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_node_killed_at_random_moments_leaves_the_survivor_finishing_each_sample_once(tmp_path):
    """Two trials: host 1 killed at a random moment of the first 14 s (start-up, training or the end
    on a quiet machine) and started again, then killed after a random step of the training;
    host 0 finishes, and the ledger says every sample was trained exactly once. (The moments are
    drawn anew each run: a failure prints its moment; benchmarks/node_loss_random.py draws many.)"""
    rng = random.Random()
    trials = [{"kill_at_s": rng.uniform(2, 14), "rejoin_after_s": 2.0},
              {"kill_after_step": rng.randint(2, 22), "kill_at_s": rng.uniform(0, 0.3)}]
    rows = []
    with netbed.NetBed(hosts=2, shared_name="vm") as bed:
        for i, how in enumerate(trials):
            work = tmp_path / f"t{i}"
            work.mkdir()
            rows.append(nodeloss.trial(bed, str(work), **how, port=29714, delay=0.002, timeout=110, env=_env(), cwd=str(ROOT)))
    for row in rows:
        assert row["completed"] and row["exactly_once"], {k: v for k, v in row.items() if k != "logs"} | {"logs": row.get("logs")}
