"""Between hosts: the socket interface chosen for the master address (tier 1), and a real
two-host run over the network test bed (two namespaces, veth, tbf; its delay line), skipped where the bed cannot
be built (needs root and `ip netns`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.paths import ROOT
from tests.support import netbed

SRC = os.path.join(str(ROOT), "src")


_REASON = netbed.unavailable_reason()
needs_bed = pytest.mark.skipif(_REASON is not None, reason=f"network test bed unavailable: {_REASON}")


@needs_bed
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_hosts_train_over_a_shaped_link():
    pytest.importorskip("sklearn")
    env = _env()
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


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _env() -> dict[str, str]:
    # The repository's root too: the scripts below import the bed as tests.support.netbed.
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, str(ROOT), os.environ.get("PYTHONPATH")) if p)}


@needs_bed
@pytest.mark.timeout(60)
def test_bed_is_removed_when_interrupted():
    script = ("import faulthandler, os, signal, sys, time\n"
              "from tests.support.netbed import NetBed\n"
              "faulthandler.register(signal.SIGUSR1)\n"  # where it is, should its clean-up stall
              "with NetBed(rate_mbit=10) as bed:\n"
              "    bed.popen(1, ['sh', '-c', 'setsid sleep 60 & sleep 60'])\n"
              "    print(' '.join(bed.namespaces), bed.bridge_namespace, flush=True)\n"
              "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    namespaces = proc.stdout.readline().split()
    assert len(namespaces) == 3, proc.stderr.read()
    proc.send_signal(15)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # seen once in CI (stop 46), not reproduced: say where it stalled
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1)
        proc.kill()
        pytest.fail(f"the bed's clean-up took over 30 s after SIGTERM; its stack:\n{proc.communicate()[1][-4000:]}")
    left = _namespaces()
    assert not any(ns in left for ns in namespaces), left
    assert not any(os.path.exists(f"/etc/netns/{ns}") for ns in namespaces)


@needs_bed
@pytest.mark.timeout(120)
def test_stale_bed_of_a_killed_process_is_removed_with_its_processes():
    script = ("import os, time\n"
              "from tests.support.netbed import NetBed\n"
              "bed = NetBed(hosts=3).__enter__()\n"
              "bed.popen(2, ['sleep', '60'])\n"
              "time.sleep(0.3)\n"
              "print(' '.join(bed.namespaces), bed.bridge_namespace, bed.pids(2)[0], flush=True)\n"
              "os.kill(os.getpid(), 9)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=90)
    *namespaces, pid = out.stdout.split()
    assert len(namespaces) == 4 and all(ns in _namespaces() for ns in namespaces), out.stderr
    netbed.remove_stale()  # (another bed's start may have removed them already)
    assert not any(ns in _namespaces() for ns in namespaces)
    for _ in range(100):
        if not _running(pid):
            break
        time.sleep(0.05)
    assert not _running(pid), "the stale bed's process is still running"


def _running(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


_SERVE = ("import socket, sys, time\n"
          "s = socket.create_server(('', 7000)); print('ready', flush=True); c, _ = s.accept(); t = time.monotonic(); n = 0\n"
          "while (b := c.recv(1 << 16)): n += len(b)\n"
          "print(n, time.monotonic() - t)\n")
_SEND = ("import socket, sys\n"
         "c = socket.create_connection((sys.argv[1], 7000)); c.sendall(bytes(1_500_000)); c.close()\n")


def _transfer(bed: netbed.NetBed, src: int, dst: int) -> float:
    server = bed.popen(dst, [sys.executable, "-c", _SERVE])
    assert server.stdout.readline().strip() == "ready"
    sender = bed.popen(src, [sys.executable, "-c", _SEND, bed.addresses[dst]])
    assert sender.wait(timeout=30) == 0
    nbytes, seconds = server.communicate(timeout=30)[0].split()
    assert int(nbytes) == 1_500_000
    return float(seconds)


@needs_bed
@pytest.mark.timeout(90)
def test_three_hosts_each_link_shaped_both_ways_and_a_host_killed_and_restarted():
    with netbed.NetBed(hosts=3, links={2: netbed.Link(rate_mbit=20)}) as bed:
        assert bed.addresses == ("10.77.0.1", "10.77.0.2", "10.77.0.3")
        # 1.5 MB at 20 Mbit/s takes >= 0.6 s whichever way it crosses host 2's link (a lower
        # bound: a loaded machine only makes it slower); the unshaped path is not timed.
        assert _transfer(bed, 2, 0) > 0.45
        assert _transfer(bed, 0, 2) > 0.45
        _transfer(bed, 0, 1)
        name = bed.popen(1, [sys.executable, "-c", "import socket; print(socket.gethostname(), socket.gethostbyname('n2'))"])
        assert name.communicate(timeout=30)[0].split() == ["n1", "10.77.0.3"]
        # A node lost: every process of host 1 ends, also one that left the command's session.
        bed.popen(1, ["sh", "-c", "setsid sleep 60 & exec sleep 60"])
        for _ in range(100):
            if len(bed.pids(1)) == 2:
                break
            time.sleep(0.05)
        assert len(bed.kill_host(1)) == 2 and bed.pids(1) == []
        again = bed.restart(1)
        time.sleep(0.3)
        assert again.poll() is None and len(bed.pids(1)) == 2
        bed.shape(2, netbed.Link())  # unshaped again, while the bed runs
        assert "tbf" not in subprocess.run(["ip", "netns", "exec", bed.namespaces[2], "tc", "qdisc", "show"],
                                           capture_output=True, text=True).stdout


PING = """
import socket, sys, time
role, addr = sys.argv[1], sys.argv[2]
if role == "serve":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, 5000)); s.listen()
    c = s.accept()[0]; c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while c.recv(1):
        c.sendall(b"y")
else:
    for _ in range(200):
        try:
            c = socket.create_connection((addr, 5000)); break
        except OSError:
            time.sleep(0.05)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for line in sys.stdin:  # one round trip per line
        t = time.perf_counter(); c.sendall(b"x"); c.recv(1)
        print((time.perf_counter() - t) * 1e3, flush=True)
"""


def _round_trips_ms(client, n=7):
    out = []
    for _ in range(n):
        client.stdin.write("\n")
        client.stdin.flush()
        out.append(float(client.stdout.readline()))
    return sorted(out)


@needs_bed
@pytest.mark.timeout(90)
def test_delay_line_holds_what_each_host_sends_for_its_delay():
    # The user-space delay line (the bed's delay where the kernel has no netem; forced here so it is
    # tested whatever the kernel): host 0 -> host 1 takes 10 ms, host 1 -> host 0 4 ms, so a round trip ~14.
    with netbed.NetBed(hosts=2, rate_mbit=50, links={1: netbed.Link(rate_mbit=50, delay_ms=4)}, delay_ms=10, delay_line=True) as bed:
        line = bed._line
        assert bed.delay_line and line is not None and line.poll() is None
        bed.popen(1, [sys.executable, "-c", PING, "serve", bed.addresses[1]])
        client = bed.popen(0, [sys.executable, "-c", PING, "ping", bed.addresses[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL)
        rtt = _round_trips_ms(client)
        assert 13.5 <= rtt[0] and rtt[len(rtt) // 2] < 40, rtt
        bed.shape(1, netbed.Link(rate_mbit=50, delay_ms=20))  # while it runs: host 1's sends now take 20 ms
        rtt = _round_trips_ms(client)
        assert 29.5 <= rtt[0] and rtt[len(rtt) // 2] < 60, rtt
        bed.shape(0, netbed.Link(rate_mbit=50))  # and host 0's none
        rtt = _round_trips_ms(client)
        assert 19.5 <= rtt[0] < 29, rtt
        assert "tbf" in subprocess.run(["ip", "netns", "exec", bed.namespaces[0], "tc", "qdisc", "show", "dev", "eth0"],
                                       capture_output=True, text=True).stdout
        namespaces = bed.namespaces
    assert line.poll() is not None, "the delay line outlived its bed"
    assert not any(ns in _namespaces() for ns in namespaces), "the bed was not removed"


@needs_bed
def test_a_bed_without_a_delay_line_cannot_be_given_a_delay_later_without_netem():
    with netbed.NetBed(rate_mbit=100) as bed:
        if bed.netem:
            pytest.skip("this kernel has netem: a delay can be added to any bed")
        assert not bed.delay_line
        with pytest.raises(netbed.NetBedUnavailable, match="no netem qdisc .* built without the delay line"):
            bed.shape(0, netbed.Link(rate_mbit=100, delay_ms=5))


@pytest.mark.timeout(60)
def test_the_delay_lines_answer_waits_a_bounded_time():
    # a delay line that stalls before its answer fails its caller, it does not hang it
    from tests.support.delayline import answer_of

    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        assert answer_of(silent, 0.3) is None
        assert time.monotonic() - t0 < 5
    finally:
        silent.kill()
        silent.wait()
    says = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True)"], stdout=subprocess.PIPE, text=True)
    try:
        assert answer_of(says, 10) == "ready"
    finally:
        says.wait()
