"""Which network interface the collectives' sockets use: gloo picks its address from the host name,
which often resolves to 127.0.0.1, so dtrain names the interface that routes to the master unless
the user set ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping, Sequence

from .._log import logger
from ..errors import ConfigError

VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915


def source_address(addr: str, port: int = 9) -> str | None:
    """The local IP address this host would send from to reach ``addr`` (None: no route or no such
    host): a connected UDP socket asks the kernel's routing table; nothing is sent."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(sockaddr)
                return s.getsockname()[0]
        except OSError:
            continue
    return None


def interface_addresses() -> dict[str, list[str]]:
    """Each interface's IP addresses (IPv4 through ioctl, IPv6 from /proc/net/if_inet6)."""
    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
            out.setdefault(name, []).append(socket.inet_ntoa(packed[20:24]))
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6:
                    out.setdefault(fields[5], []).append(str(ipaddress.IPv6Address(int(fields[0], 16))))
    except OSError:
        pass
    return out


def interface_of(local: str) -> str | None:
    """The interface that holds the local address ``local`` (None: no such interface)."""
    want = ipaddress.ip_address(local.split("%")[0])
    for name, addresses in interface_addresses().items():
        if any(ipaddress.ip_address(a) == want for a in addresses):
            return name
    return None


def route_interface(addr: str) -> tuple[str, str] | None:
    """(interface, local address) that routes to ``addr``, or None when unknown."""
    local = source_address(addr)
    if local is None:
        return None
    name = interface_of(local)
    return (name, local) if name is not None else None


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def loopback_interface() -> str | None:
    """The name of the interface that holds 127.0.0.1 (``lo`` on Linux)."""
    return interface_of("127.0.0.1")


def socket_env(master_addr: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The ``*_SOCKET_IFNAME`` variables the user did not set, naming the interface that routes to
    ``master_addr`` (loopback for a loopback master); empty when none is found."""
    if all(environ.get(v) for v in VARIABLES):
        return {}
    name = loopback_interface() if is_loopback(master_addr) else (route_interface(master_addr) or (None,))[0]
    return {v: name for v in VARIABLES if not environ.get(v)} if name else {}


def _resolves_to_loopback(addr: str) -> bool:
    """Whether every address ``addr`` resolves to is a loopback one (a name that does not resolve: no)."""
    if is_loopback(addr):
        return True
    try:
        found = {info[4][0] for info in socket.getaddrinfo(addr, None)}
    except OSError:
        return False
    return bool(found) and all(is_loopback(a.split("%")[0]) for a in found)


def user_interface_problem(master_addr: str, environ: Mapping[str, str], variables: Sequence[str] = VARIABLES) -> str | None:
    """Why a ``*_SOCKET_IFNAME`` the user set cannot carry a job whose master is ``master_addr``
    (None: fine): an interface this host lacks, or loopback where the master is another host.
    NCCL's value is a list of prefixes (``=`` exact, ``^`` excludes: not judged)."""
    names = [name for _, name in socket.if_nameindex()]
    loop = loopback_interface()
    between_hosts = not _resolves_to_loopback(master_addr)
    for var in variables:
        value = environ.get(var, "").strip()
        if not value or value.startswith("^"):
            continue
        exact = var == "GLOO_SOCKET_IFNAME" or value.startswith("=")
        for want in filter(None, (w.strip() for w in value.lstrip("=").split(","))):
            matched = [n for n in names if n == want or (not exact and n.startswith(want))]
            if not matched:
                return (f"{var}={value} names no interface of this host (it has: {', '.join(names)}); unset it "
                        f"(dtrain then uses the interface that routes to {master_addr}) or name one of these")
            if between_hosts and loop is not None and set(matched) == {loop}:
                return (f"{var}={value} is the loopback interface, but the nodes meet at {master_addr}: the other "
                        f"nodes cannot connect to this one there; unset it (dtrain then uses the interface that "
                        f"routes to {master_addr}) or name the interface of the network the nodes share")
    return None


BACKEND_VARIABLE = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


def use_route_interface(master_addr: str, *, quiet: bool = False, backend: str | None = None) -> dict[str, str]:
    """Set ``socket_env``'s variables in this process (its workers inherit them) and return them;
    where ``backend`` is known, a user's setting of its variable that cannot work is a ConfigError."""
    judged = [BACKEND_VARIABLE[backend]] if backend in BACKEND_VARIABLE else []
    problem = user_interface_problem(master_addr, os.environ, judged)
    if problem is not None:
        raise ConfigError(problem)
    chosen = socket_env(master_addr, os.environ)
    os.environ.update(chosen)
    if chosen and not quiet and not is_loopback(master_addr):
        names = ", ".join(f"{k}={v}" for k, v in chosen.items())
        logger.info(f"sockets between nodes use the interface that routes to {master_addr}: {names} (set them yourself to choose another)")
    return chosen
