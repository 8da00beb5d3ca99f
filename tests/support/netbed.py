"""A test bed of N hosts on one machine: N network namespaces, each joined by its own veth pair to
a bridge in a namespace of the bed's own (not the machine's), each host's link shaped with ``tc``
(rate with ``tbf`` in both directions; delay with ``netem``, or where the kernel has no netem, with
a user-space wire between each host and the bridge: ``delayline``).

    with NetBed(hosts=3, rate_mbit=100, links={2: Link(rate_mbit=20)}) as bed:   # root, iproute2
        outs = bed.run_nodes(lambda rank, master: ["dtrain", "train", "--nnodes", "3",
                             "--node-rank", str(rank), "--master-addr", master], timeout=600)
        bed.popen(1, [...]); bed.kill_host(1); bed.restart(1)      # a node lost, then back

Host ``i`` has the address ``SUBNET.(i+1)`` and, where ``unshare`` exists, the host name ``n<i>``
(a UTS namespace of its own; ``/etc/netns/<namespace>/hosts`` names every host of the bed, as
iproute2 lets a namespace have its own ``/etc`` files), so what a program learns from its host
name (torch's elastic agent announces it to its peers) is that host's, as on real machines.

``shared_name="vm"`` builds the bed as many users have it instead: every host has the same host
name, and each host's ``/etc/hosts`` maps it to a loopback address (``shared_addr``, 127.0.0.1;
127.0.1.1 as Debian/Ubuntu write it) and names no other host, so a program that advertises its
host name tells its peers to connect to their own loopback.

From the shell (``{node_rank}``, ``{master_addr}``, ``{host_addr}`` and ``{hosts}`` in the
command are filled in per host):

    python -m tests.support.netbed --hosts 3 --rate-mbit 100 --link 2:20 -- dtrain train \\
        --task mnist --nnodes {hosts} --node-rank {node_rank} --master-addr {master_addr}

Everything the bed creates is removed again on exit, on an exception, on SIGINT/SIGTERM/SIGHUP,
and namespaces (and the processes in them) left by a bed whose process died are removed by the
next bed.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PREFIX = "dtbed"
_OWNED = re.compile(rf"^{PREFIX}(\d+)-\d+-(h\d+|br)$")  # dtbed<pid>-<seq>-h<i> and dtbed<pid>-<seq>-br
_ETC_NETNS = "/etc/netns"
_seq = itertools.count()


class NetBedUnavailable(RuntimeError):
    """The test bed cannot be built here (not root, no iproute2, no TAP device for a delay...)."""


@dataclass(frozen=True)
class Link:
    """How one host's link to the bridge is shaped."""

    rate_mbit: float | None = None
    """Mbit/s the host can send, and receive (None: unshaped)."""
    delay_ms: float | None = None
    """Added to what the host sends (netem, or the delay line), so host A to host B takes A's delay one way."""

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not (math.isfinite(self.rate_mbit) and self.rate_mbit > 0):
            raise ValueError(f"rate_mbit must be a finite number > 0, got {self.rate_mbit}")
        if self.delay_ms is not None and not (math.isfinite(self.delay_ms) and self.delay_ms >= 0):
            raise ValueError(f"delay_ms must be a finite number >= 0, got {self.delay_ms}")


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


def namespace_pids(ns: str) -> list[int]:
    """Every process whose network namespace is ``ns`` (whatever its session or parent)."""
    return [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]


def _kill_namespace(ns: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process in ``ns`` until none is left (a dying one may still fork)."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while (pids := namespace_pids(ns)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            if pid not in killed:
                killed.append(pid)
        time.sleep(0.05)
    return killed


def _delete_namespace(ns: str) -> None:
    _kill_namespace(ns)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(os.path.join(_ETC_NETNS, ns), ignore_errors=True)


def remove_stale() -> list[str]:
    """Delete the namespaces (and end their processes) of beds whose process is gone."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _OWNED.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _delete_namespace(name)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class NodeOutput:
    node_rank: int
    returncode: int | None
    """None: still running at the timeout (then killed)."""
    output: str


class NetBed:
    """``hosts`` hosts (namespaces): host ``i`` at ``SUBNET.(i+1)``, each on its own link to one bridge.

    ``rate_mbit`` / ``delay_ms`` shape every host's link; ``links`` gives some hosts their own
    :class:`Link` (by host index). With two hosts and ``rate_mbit`` alone, the path between them
    runs at that rate, as the two-host bed's single link did."""

    def __init__(self, *, hosts: int = 2, rate_mbit: float | None = None, delay_ms: float | None = None,
                 links: Mapping[int, Link] | None = None, subnet: str = "10.77.0", hostnames: bool = True,
                 shared_name: str | None = None, shared_addr: str = "127.0.0.1", delay_line: bool | None = None) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be 1..250, got {hosts}")
        default = Link(rate_mbit=rate_mbit, delay_ms=delay_ms)
        unknown = sorted(set(links or {}) - set(range(hosts)))
        if unknown:
            raise ValueError(f"links name host(s) {unknown}, but the bed has hosts 0..{hosts - 1}")
        self.links = [dict(links or {}).get(i, default) for i in range(hosts)]
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        self.addresses = tuple(f"{subnet}.{i + 1}" for i in range(hosts))
        tag = f"{PREFIX}{os.getpid()}-{next(_seq)}-"
        self.namespaces = tuple(f"{tag}h{i}" for i in range(hosts))
        self.bridge_namespace = f"{tag}br"
        if shared_name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]{0,62}", shared_name):
            raise ValueError(f"shared_name must be a host name (letters, digits, '.', '-'), got {shared_name!r}")
        self.shared_name = shared_name
        self.shared_addr = shared_addr
        self.names = tuple(shared_name or f"n{i}" for i in range(hosts))
        """Each host's host name (when ``hostnames`` and ``unshare`` exists; else the machine's)."""
        self._hostnames = (hostnames or shared_name is not None) and all(shutil.which(t) for t in ("unshare", "hostname"))
        if shared_name is not None and not self._hostnames:
            raise NetBedUnavailable("a bed with a shared host name needs `unshare` and `hostname` (util-linux)")
        self._procs: list[subprocess.Popen] = []
        self._last: dict[int, tuple[list[str], dict[str, Any]]] = {}
        self._old_handlers: dict[int, Any] = {}
        self.netem = False
        """Whether this kernel has the netem qdisc (delay); known after entering."""
        self.delay_line = delay_line
        """Whether the hosts' delays are the user-space delay line's (``delayline``) rather than
        netem's: given, or (None) where a link has a delay and the kernel has no netem; known
        after entering."""
        self._line: subprocess.Popen | None = None

    @property
    def threads_per_host(self) -> int:
        """This machine's cores divided among the hosts (at least 1): the OMP_NUM_THREADS each
        host's programs get unless their environment sets it."""
        from dtrain.data import usable_cores

        return max(1, usable_cores() // self.hosts)

    @property
    def hosts(self) -> int:
        return len(self.namespaces)

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
        br = self.bridge_namespace
        _ip("netns", "add", br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        self.netem = self._probe_netem()
        if self.delay_line is None:
            self.delay_line = not self.netem and any(link.delay_ms for link in self.links)
        if self.delay_line:
            from . import delayline

            try:
                self._line = delayline.start(br, [link.delay_ms or 0.0 for link in self.links])
            except RuntimeError as exc:
                raise NetBedUnavailable(str(exc)) from None
            self._procs.append(self._line)
        for i, (ns, addr) in enumerate(zip(self.namespaces, self.addresses)):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # eth0 in the host, h<i> on the bridge: names are per namespace, so beds never clash.
            if self.delay_line:  # the delay line's TAP pair: t<i> becomes the host's eth0
                _ip("-n", br, "link", "set", f"t{i}", "netns", ns, "name", "eth0")
            else:
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"h{i}", "netns", br)
            _ip("-n", br, "link", "set", f"h{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        if self._hostnames:
            table = "127.0.0.1 localhost\n::1 localhost\n"
            if self.shared_name is None:
                table += "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.names))
            else:  # one name for all, resolving to this host's own loopback (the Debian/Ubuntu line)
                table += f"{self.shared_addr} {self.shared_name}\n"
            for ns in self.namespaces:
                os.makedirs(os.path.join(_ETC_NETNS, ns), exist_ok=True)
                with open(os.path.join(_ETC_NETNS, ns, "hosts"), "w") as f:
                    f.write(table)
                # No DNS server is reachable from the bed: a name lookup that misses the hosts file
                # fails at once (as a network's DNS would answer), instead of waiting 5 s x 2 for the
                # machine's server (c10d's reverse lookup of each peer did, for every connection).
                with open(os.path.join(_ETC_NETNS, ns, "resolv.conf"), "w") as f:
                    f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        for i, link in enumerate(self.links):
            self.shape(i, link)

    def _probe_netem(self) -> bool:
        ns = self.bridge_namespace
        ok = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms"],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        return ok

    def shape(self, host: int, link: Link) -> None:
        """Shape ``host``'s link now (also while programs run): what it sends on its own end of
        the veth, what it receives on the bridge's end (rate only; the delay is the sender's)."""
        if self._line is not None:
            from .delayline import set_delay

            set_delay(self._line, host, link.delay_ms or 0.0)
        elif link.delay_ms and not self.netem:
            raise NetBedUnavailable("this kernel has no netem qdisc (sch_netem) and this bed was built without the delay line, "
                                    "so the link cannot be given a delay now; build the bed with a delay or delay_line=True")
        self._qdisc(self.namespaces[host], "eth0", link if self._line is None else Link(rate_mbit=link.rate_mbit))
        self._qdisc(self.bridge_namespace, f"h{host}", Link(rate_mbit=link.rate_mbit))
        self.links[host] = link

    @staticmethod
    def _qdisc(ns: str, dev: str, link: Link) -> None:
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc"]
        subprocess.run([*tc, "del", "dev", dev, "root"], capture_output=True)  # none yet: fine
        if link.delay_ms:
            cmd = [*tc, "add", "dev", dev, "root", "netem", "delay", f"{link.delay_ms}ms"] + \
                (["rate", f"{link.rate_mbit}mbit"] if link.rate_mbit else [])
        elif link.rate_mbit:
            # burst: ~2 ms at the rate (at least 16 KiB); queue up to 100 ms before dropping.
            burst = max(16 * 1024, int(link.rate_mbit * 1e6 / 8 * 0.002))
            cmd = [*tc, "add", "dev", dev, "root", "tbf", "rate", f"{link.rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
        else:
            return
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise NetBedUnavailable(f"`{' '.join(cmd[4:])}` failed: {proc.stderr.strip()}")

    def close(self) -> None:
        """End every process in the bed's hosts (whatever session it made for itself) and delete
        the namespaces (and with them the veth pairs and the bridge)."""
        if self._line is not None and self._line.stdin:
            self._line.stdin.close()  # the delay line's end of input: it stops
        for ns in self.namespaces:
            _kill_namespace(ns)
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
            proc.wait()
        self._procs.clear()
        self._line = None
        for ns in (*self.namespaces, self.bridge_namespace):
            _delete_namespace(ns)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # -- running ---------------------------------------------------------------------------------
    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on ``host``, in its own process group; output captured unless ``stdout``
        is given. :meth:`restart` starts the host's last command again."""
        self._last[host] = (list(argv), dict(kwargs))
        # The hosts share this machine's cores; a real host would have its own. Unless the caller
        # says otherwise, each host's programs get its share of the cores as torch threads (one
        # process per host sees every core, and N hosts x all cores oversubscribe them: compute on
        # a healthy 3-host bed ran ~10x slower than on one machine, and unevenly).
        env = dict(kwargs.get("env") or os.environ)
        env.setdefault("OMP_NUM_THREADS", str(self.threads_per_host))
        kwargs["env"] = env
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.STDOUT)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        prefix = ["ip", "netns", "exec", self.namespaces[host]]
        if self._hostnames:  # a host name of its own; exec keeps the Popen's pid the program's
            prefix += ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', self.names[host]]
        proc = subprocess.Popen([*prefix, *argv], text=True, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def pids(self, host: int) -> list[int]:
        """The processes running on ``host`` now."""
        return namespace_pids(self.namespaces[host])

    def kill_host(self, host: int) -> list[int]:
        """``kill -9`` every process of ``host`` (a node lost for good); returns their pids."""
        killed = _kill_namespace(self.namespaces[host])
        for proc in self._procs:
            if proc.args[3:4] == [self.namespaces[host]]:
                proc.wait()
        return killed

    def restart(self, host: int) -> subprocess.Popen:
        """Start ``host``'s last command again (after :meth:`kill_host`, or once it ended)."""
        if host not in self._last:
            raise ValueError(f"nothing was started on host {host} yet")
        if self.pids(host):
            self.kill_host(host)
        argv, kwargs = self._last[host]
        return self.popen(host, argv, **kwargs)

    def run_nodes(self, command: Callable[[int, str], Sequence[str]], *, timeout: float = 600.0,
                  env: dict[str, str] | None = None) -> list[NodeOutput]:
        """Run ``command(node_rank, master_addr)`` on every host at once; each host's output and status."""
        with tempfile.TemporaryDirectory(prefix="dtbed-out-") as tmp:
            # Files, not pipes: a host whose pipe nobody reads would block in a write (and its peers with it).
            files = [open(os.path.join(tmp, f"h{r}"), "w+") for r in range(self.hosts)]
            procs = [self.popen(r, list(command(r, self.addresses[0])), env=env, stdout=f) for r, f in enumerate(files)]
            deadline = time.monotonic() + timeout
            codes: list[int | None] = []
            for proc in procs:
                try:
                    codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    codes.append(None)
            for r, code in enumerate(codes):
                if code is None:
                    _kill_namespace(self.namespaces[r])
                    procs[r].wait()
            outs = []
            for f in files:
                f.seek(0)
                outs.append(f.read())
                f.close()
        return [NodeOutput(r, c, o) for r, (c, o) in enumerate(zip(codes, outs))]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.support.netbed``: the bed from the shell (``netbed_cli``)."""
    from .netbed_cli import main as cli

    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
