"""A two-host test bed on one machine: two network namespaces joined by a veth pair whose link
is shaped with ``tc`` (rate with ``tbf``; delay with ``netem`` where the kernel has it).

    with NetBed(rate_mbit=100) as bed:                 # needs root and iproute2
        outs = bed.run_nodes(lambda rank, master: ["dtrain", "train", "--nnodes", "2",
                             "--node-rank", str(rank), "--master-addr", master], timeout=600)

From the shell (each ``{node_rank}`` and ``{master_addr}`` in the command is filled in per host):

    python -m dtrain.testing.netbed --rate-mbit 100 -- dtrain train --task mnist \\
        --nnodes 2 --node-rank {node_rank} --master-addr {master_addr} --comm auto

Everything the bed creates is removed again on exit, on an exception, on SIGINT/SIGTERM/SIGHUP,
and namespaces left by a bed whose process died are removed by the next bed.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

PREFIX = "dtbed"


class NetBedUnavailable(RuntimeError):
    """The test bed cannot be built here (not root, no iproute2, no netem for a delay...)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetBedUnavailable(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def unavailable_reason() -> str | None:
    """Why no bed can be built here, or None when one can (creates and deletes a namespace)."""
    if os.geteuid() != 0:
        return "the network test bed needs root (it creates network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the network test bed needs `{tool}` (iproute2)"
    name = f"{PREFIX}probe{os.getpid()}"
    proc = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"`ip netns add` is not permitted here ({proc.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def remove_stale() -> list[str]:
    """Delete namespaces of beds whose process is gone (e.g. killed with SIGKILL)."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX) or name.startswith(f"{PREFIX}probe"):
            continue
        pid = name[len(PREFIX):].split("h")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class NodeOutput:
    node_rank: int
    returncode: int | None
    """None: still running at the timeout (then killed)."""
    output: str


class NetBed:
    """Two hosts (namespaces) ``host 0`` at 10.77.0.1 and ``host 1`` at 10.77.0.2 on one shaped link."""

    def __init__(self, *, rate_mbit: float | None = None, delay_ms: float | None = None, subnet: str = "10.77.0") -> None:
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        self.addresses = (f"{subnet}.1", f"{subnet}.2")
        tag = f"{PREFIX}{os.getpid()}h"
        self.namespaces = (f"{tag}0", f"{tag}1")
        self._veth = (f"dtb{os.getpid() % 100000}a", f"dtb{os.getpid() % 100000}b")
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, Any] = {}
        self.netem = False
        """Whether this kernel has the netem qdisc (delay); known after entering."""

    # -- life cycle ------------------------------------------------------------------------------
    def __enter__(self) -> NetBed:
        reason = unavailable_reason()
        if reason:
            raise NetBedUnavailable(reason)
        remove_stale()
        self._catch_signals()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _catch_signals(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; `with` still cleans up

        def stop(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt(f"signal {signum}")  # unwinds through __exit__

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, stop)

    def _build(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", self._veth[0], "netns", self.namespaces[0], "type", "veth", "peer", "name", self._veth[1], "netns", self.namespaces[1])
        for ns, dev, addr in zip(self.namespaces, self._veth, self.addresses):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        self.netem = self._probe_netem()
        if self.delay_ms and not self.netem:
            raise NetBedUnavailable("this kernel has no netem qdisc (sch_netem), so the link cannot be given a delay; "
                                    "shape the rate only (tbf)")
        for ns, dev in zip(self.namespaces, self._veth):  # each side shapes what it sends
            self._shape(ns, dev)

    def _probe_netem(self) -> bool:
        ns = self.namespaces[0]
        ok = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms"],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        return ok

    def _shape(self, ns: str, dev: str) -> None:
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
        if self.delay_ms:
            cmd = [*tc, "netem", "delay", f"{self.delay_ms}ms"] + (["rate", f"{self.rate_mbit}mbit"] if self.rate_mbit else [])
        elif self.rate_mbit:
            # burst: ~2 ms at the rate (at least 16 KiB); queue up to 100 ms before dropping.
            burst = max(16 * 1024, int(self.rate_mbit * 1e6 / 8 * 0.002))
            cmd = [*tc, "tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
        else:
            return
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise NetBedUnavailable(f"`{' '.join(cmd[4:])}` failed: {proc.stderr.strip()}")

    def close(self) -> None:
        """Stop every process started in the bed and delete the namespaces (and with them the veth pair)."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait()
        self._procs.clear()
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # -- running ---------------------------------------------------------------------------------
    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (0 or 1), in its own process group; output captured."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.STDOUT)
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *argv], text=True,
                                start_new_session=True, stdin=subprocess.DEVNULL, **kwargs)
        self._procs.append(proc)
        return proc

    def run_nodes(self, command: Callable[[int, str], Sequence[str]], *, timeout: float = 600.0,
                  env: dict[str, str] | None = None) -> list[NodeOutput]:
        """Run ``command(node_rank, master_addr)`` on both hosts at once; each host's output and status."""
        procs = [self.popen(r, list(command(r, self.addresses[0])), env=env) for r in (0, 1)]
        deadline = time.monotonic() + timeout
        outs: list[str] = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                proc.returncode = None  # type: ignore[assignment]
            outs.append(out or "")
        return [NodeOutput(r, p.returncode, o) for r, (p, o) in enumerate(zip(procs, outs))]


def main(argv: Sequence[str] | None = None) -> int:
    from ..cli import Parser  # one-line usage errors, exit 2, as the dtrain command

    parser = Parser(prog="python -m dtrain.testing.netbed", description=__doc__.split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, default=None, help="link rate in Mbit/s (tbf; default: unshaped)")
    parser.add_argument("--delay-ms", type=float, default=None, help="one-way delay per side (needs netem)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="kill both nodes after this many seconds")
    parser.add_argument("--check", action="store_true", help="only say whether a bed can be built here, and whether netem exists")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND with {node_rank} and {master_addr}")
    args = parser.parse_args(argv)
    for flag, value in (("--rate-mbit", args.rate_mbit), ("--delay-ms", args.delay_ms), ("--timeout", args.timeout)):
        if value is not None and not (math.isfinite(value) and (value > 0 or flag == "--delay-ms" and value == 0)):
            parser.error(f"{flag} must be a finite number > 0, got {value:g}")
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        with NetBed(rate_mbit=args.rate_mbit, delay_ms=args.delay_ms) as bed:
            print(f"netbed: hosts {bed.addresses[0]} and {bed.addresses[1]}; rate "
                  f"{f'{args.rate_mbit:g} Mbit/s (tbf)' if args.rate_mbit else 'unshaped'}; netem "
                  f"{'available' if bed.netem else 'NOT available in this kernel (no delay can be added)'}", flush=True)
            if args.check or not cmd:
                return 0
            outs = bed.run_nodes(lambda r, m: [a.format(node_rank=r, master_addr=m) for a in cmd], timeout=args.timeout)
    except NetBedUnavailable as exc:
        print(f"dtrain: error: netbed: {exc}.", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("netbed: interrupted; the bed was removed.", file=sys.stderr)
        return 130
    for o in outs:
        status = "timed out" if o.returncode is None else f"exit {o.returncode}"
        print(f"--- node {o.node_rank} ({status}) ---\n{o.output.rstrip()}", flush=True)
    return max((1 if o.returncode is None else abs(o.returncode)) for o in outs)


if __name__ == "__main__":
    sys.exit(main())
