"""The address a node gives the others, and the one-line reasons a node could not be reached.
torch's agent advertises ``socket.getfqdn()``, which often resolves to loopback
(pytorch/pytorch#111646); dtrain hands it the address that routes to the master instead."""

from __future__ import annotations

import errno
import ipaddress
import socket
import time
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, LaunchError, first_line
from .netif import is_loopback, source_address


def advertised_address(master_addr: str, local_addr: str | None = None) -> str:
    """The address this node advertises to the others: ``local_addr`` when given (it must be
    an address of this host), else the source address of the route to ``master_addr``."""
    if local_addr:
        check_not_wildcard("--local-addr", local_addr)
        _check_own(local_addr)
        ip = resolves_to(local_addr)
        if ip and is_loopback(ip) and not is_loopback(master_addr):
            raise ConfigError(f"--local-addr {local_addr} is {ip}, a loopback address the other nodes cannot reach; "
                              f"give this node's address on the network of --master-addr {master_addr}.")
        return local_addr
    found = source_address(master_addr)
    if found is None:
        raise ConfigError(f"--master-addr {master_addr}: this node has no route there, so it has no address the other nodes "
                          "could reach; check the address (and this host's routes), or pass --local-addr.")
    return found


def check_not_wildcard(flag: str, addr: str) -> None:
    """Refuse a wildcard (0.0.0.0, ::): told to another node, it means that node's own host."""
    ip = resolves_to(addr[1:-1] if addr.startswith("[") and addr.endswith("]") else addr)
    try:
        wildcard = ip is not None and ipaddress.ip_address(ip.split("%")[0]).is_unspecified
    except ValueError:
        wildcard = False
    if wildcard:
        raise ConfigError(f"{flag} {addr} is a wildcard address (every interface), not one the other nodes can reach; "
                          "give the address of this node's interface on the network the nodes share (see `ip -brief "
                          "addr`), or leave it out to use the interface that routes to --master-addr.")


def _check_own(addr: str) -> None:
    try:
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"--local-addr {addr} does not resolve ({exc.strerror}); give this node's IP address.") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((sockaddr[0], 0))
        except OSError:
            raise ConfigError(f"--local-addr {addr} is not an address of this host; give the address of this node's "
                              "interface on the network the nodes share (see `ip -brief addr`).") from None


def resolves_to(name: str) -> str | None:
    """What ``name`` resolves to here (None: it does not resolve)."""
    try:
        return socket.getaddrinfo(name, 0, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, IndexError, UnicodeError):
        return None


def unreachable_cause(addr: str, *, here_is_master: bool) -> str:
    """The likely reason this node could not reach ``addr`` (a store), in a few words."""
    ip = resolves_to(addr)
    if ip is None:
        return f"{addr} does not resolve on this node; use an IP address or fix /etc/hosts"
    if is_loopback(ip) and not here_is_master and not is_loopback(addr):
        return (f"{addr} resolves to {ip} (loopback) on this node; pass --local-addr on the node that "
                f"advertised it, or fix /etc/hosts")
    if is_loopback(ip) and not here_is_master:
        return f"{addr} is a loopback address, reachable on its own node only; pass --local-addr or a routable --master-addr"
    if source_address(ip) is None:
        return f"this node has no route to {ip}; check the address and the routes"
    return f"nothing answered at {addr}; the node there may be gone, or a firewall drops the connection"


def wait_for_listener(addr: str, port: int, timeout_s: float,
                      on_wait: Callable[[float, OSError], None] | None = None) -> OSError | None:
    """Try TCP connections to ``addr:port`` until one is accepted (None) or ``timeout_s`` has passed
    (the last try's error; torch's client would log C++ frames); ``on_wait(elapsed_s, error)`` may raise to stop."""
    start = time.monotonic()
    while True:
        left = start + timeout_s - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=min(5.0, max(0.2, left))):
                return None
        except socket.gaierror as exc:
            return exc  # the name does not resolve: waiting will not change that
        except OSError as exc:
            error = exc
        elapsed = time.monotonic() - start
        if on_wait is not None:
            on_wait(elapsed, error)
        if elapsed >= timeout_s:
            return error
        time.sleep(min(0.5, timeout_s - elapsed))


def refusal(error: OSError) -> str:
    """A failed connection's reason, in a few words."""
    if isinstance(error, socket.timeout):
        return "no answer"
    if error.errno == errno.ECONNREFUSED:
        return "connection refused (nothing listens there)"
    return (error.strerror or type(error).__name__).lower()


# -- the workers' store and process group: each wait bounded, each failure one line ---------------

def listening_socket(addr: str, port: int) -> socket.socket:
    """A socket listening on ``addr:port`` only (port 0: a free one); OSError where it cannot be."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def worker_store(world: Any, timeout_s: float) -> Any:
    """The store one elastic round's workers meet in: rank 0 hosts it on MASTER_ADDR only (torch's
    env:// store listens on every interface); the others connect within ``timeout_s``."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if world.rank == 0:
        try:
            extra = {"master_listen_fd": listening_socket(world.master_addr, world.master_port).detach()}
        except OSError:
            extra = {}
        return dist.TCPStore(world.master_addr, world.master_port, None, True, timeout, wait_for_workers=False, **extra)
    return connect_store(world, timeout_s)


def connect_store(world: Any, timeout_s: float) -> Any:
    """A client of the store at ``world.master_addr:master_port``; one LaunchError line after ``timeout_s``."""
    import datetime

    import torch.distributed as dist

    start = time.monotonic()
    error: BaseException | None = wait_for_listener(world.master_addr, world.master_port, timeout_s)
    if error is None:
        left = max(1.0, timeout_s - (time.monotonic() - start))
        try:
            return dist.TCPStore(world.master_addr, world.master_port, None, False, datetime.timedelta(seconds=left))
        except (RuntimeError, ValueError) as exc:
            error = exc
    cause = unreachable_cause(world.master_addr, here_is_master=world.node_rank == 0)
    why = refusal(error) if isinstance(error, OSError) else f"torch: {first_line(error, 160)}"
    raise LaunchError(f"{node_name(world)} could not connect to the store at {world.master_addr}:{world.master_port} "
                      f"within {timeout_s:g} s: {cause} ({why})")


def node_name(world: Any) -> str:
    """``node 1 (10.77.0.2)``: this node as the others know it."""
    here = source_address(world.master_addr)
    here = None if here is None or is_loopback(here) else here  # loopback says nothing to the other nodes
    return f"node {world.node_rank}" + (f" ({here})" if here else "") + f", rank {world.rank},"


_ARRIVED = "/dtrain/arrived/"


def arrive(store: Any, world: Any) -> None:
    """Say in the store that this rank has come to the process group (for ``missing``)."""
    store.set(f"{_ARRIVED}{world.rank}", str(world.node_rank))


def missing(store: Any, world: Any) -> str:
    """The ranks (and their nodes) that have not come, as a short phrase; '' when all have."""
    try:
        gone = [r for r in range(world.size) if not store.check([f"{_ARRIVED}{r}"])]
    except Exception:  # noqa: BLE001 -- the store itself is gone: nothing more to tell
        return ""
    if not gone:
        return ""
    local = max(1, world.local_size)
    nodes = sorted({r // local for r in gone})
    return f"rank(s) {', '.join(map(str, gone[:8]))}{' ...' if len(gone) > 8 else ''} of node(s) {', '.join(map(str, nodes))}"


def join_failure(world: Any, store: Any, timeout_s: float, exc: BaseException, what: str) -> LaunchError:
    """The one line for a process group that did not form (or whose first collective did not end)."""
    gone = missing(store, world) if store is not None else ""
    who = f"{gone} never arrived" if gone else "a peer did not answer"
    return LaunchError(f"{node_name(world)} waited {timeout_s:g} s for {what} at {world.master_addr}:{world.master_port}: "
                       f"{who}; that node was lost, or it cannot reach this one (check that it runs, its output, "
                       f"and --local-addr; --startup-timeout bounds this wait) (torch: {first_line(exc, 160)})")
