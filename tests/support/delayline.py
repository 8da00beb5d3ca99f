"""The test bed's delay where the kernel has no netem: a user-space wire between each host and the
bridge that holds what the host sends for the host's delay.

Each host's link is a pair of TAP devices instead of a veth pair: ``t<i>`` (moved into the host's
namespace as ``eth0``) and ``h<i>`` (on the bridge). This program runs in the bed's bridge
namespace, owns both ends, and copies frames between them: what host ``i`` sends (read from
``t<i>``, after that device's ``tbf``) reaches the bridge ``delay[i]`` later, in order; what the
bridge sends to host ``i`` (read from ``h<i>``, after its ``tbf``) goes on at once. So host A to
host B takes A's delay one way, as the bed's netem delay does.

    ip netns exec BRIDGE_NS python -m tests.support.delayline --delays 10,0

prints ``ready`` once the devices exist; then each line ``HOST MS`` on its standard input sets
that host's delay (answered ``ok``), and the end of its input ends it (the bed that started it is
gone). It is a Python loop: it adds CPU work (about one core-percent per thousand frames a second)
and scheduling jitter on a busy machine, and suits links up to ~100 Mbit/s.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import selectors
import struct
import subprocess
import sys
import time
from collections import deque

_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000
_FRAME = 65536


def open_tap(name: str) -> int:
    """A TAP device ``name`` in this namespace, and the descriptor that is its wire."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


def _send(fd: int, frame: bytes) -> None:
    try:
        os.write(fd, frame)
    except OSError:  # the device is down or gone (its host is being removed): a wire drops it
        pass


def relay(hosts: list[int], bridge: list[int], delays: list[float], control: int, answer) -> None:
    """Copy frames until ``control`` ends: host ``i``'s (``hosts[i]``) to ``bridge[i]`` after
    ``delays[i]`` seconds, the bridge's to the host at once."""
    sel = selectors.DefaultSelector()
    for i, (h, b) in enumerate(zip(hosts, bridge)):
        sel.register(h, selectors.EVENT_READ, (i, True))
        sel.register(b, selectors.EVENT_READ, (i, False))
    os.set_blocking(control, False)
    sel.register(control, selectors.EVENT_READ, None)
    queues: list[deque[tuple[float, bytes]]] = [deque() for _ in hosts]
    pending = b""
    while True:
        due = [q[0][0] for q in queues if q]
        timeout = max(0.0, min(due) - time.monotonic()) if due else None
        for key, _ in sel.select(timeout):
            if key.data is None:
                data = os.read(control, 4096)
                if not data:
                    return
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    host, ms = line.split()
                    delays[int(host)] = float(ms) / 1e3
                    answer("ok")
                continue
            i, sent = key.data
            while True:
                try:
                    frame = os.read(key.fd, _FRAME)
                except BlockingIOError:
                    break
                except OSError:  # the device went away with its namespace
                    return
                if not sent:
                    _send(hosts[i], frame)
                elif delays[i] <= 0 and not queues[i]:
                    _send(bridge[i], frame)
                else:
                    queues[i].append((time.monotonic() + delays[i], frame))
        now = time.monotonic()
        for i, q in enumerate(queues):
            while q and q[0][0] <= now:
                _send(bridge[i], q.popleft()[1])


START_TIMEOUT_S = 30.0
"""How long ``start`` waits for the program's "ready" (it opens two TAP devices per host)."""
ANSWER_TIMEOUT_S = 10.0
"""How long ``set_delay`` waits for its "ok"."""


def start(bridge_namespace: str, delays_ms: list[float]) -> subprocess.Popen:
    """This program in ``bridge_namespace``, once its devices ``t<i>`` and ``h<i>`` exist there."""
    # By its path: it imports nothing of dtrain's, so it runs whatever put dtrain on the caller's path.
    proc = subprocess.Popen(["ip", "netns", "exec", bridge_namespace, sys.executable, os.path.abspath(__file__),
                             "--delays", ",".join(f"{d:g}" for d in delays_ms)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    said = answer_of(proc, START_TIMEOUT_S)
    if said != "ready":
        proc.kill()
        why = f"no answer in {START_TIMEOUT_S:g} s" if said is None else proc.communicate()[1].strip()[-500:]
        raise RuntimeError(f"the delay line did not start: {why}")
    return proc


def answer_of(proc: subprocess.Popen, timeout: float) -> str | None:
    """The program's next line, or None where none came in ``timeout`` seconds (a stalled
    program fails its caller instead of hanging it). Each request gets one line back, so no
    line waits in the pipe's buffer beyond the one asked for."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return None
    return proc.stdout.readline().strip()


def set_delay(proc: subprocess.Popen, host: int, ms: float) -> None:
    """Host ``host``'s delay, from now on (what it already sent keeps its own)."""
    proc.stdin.write(f"{host} {ms:g}\n")
    proc.stdin.flush()
    said = answer_of(proc, ANSWER_TIMEOUT_S)
    if said != "ok":
        raise RuntimeError("the delay line has ended" if said is not None else f"the delay line did not answer in {ANSWER_TIMEOUT_S:g} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.delayline", description=__doc__.split("\n\n")[0])
    p.add_argument("--delays", required=True, help="each host's delay in ms, comma-separated (host 0 first)")
    args = p.parse_args(argv)
    delays = [float(d) / 1e3 for d in args.delays.split(",")]
    hosts = [open_tap(f"t{i}") for i in range(len(delays))]
    bridge = [open_tap(f"h{i}") for i in range(len(delays))]

    def answer(text: str) -> None:
        print(text, flush=True)

    answer("ready")
    relay(hosts, bridge, delays, sys.stdin.fileno(), answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
