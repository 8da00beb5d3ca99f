"""The rendezvous store, hosted by node 0's launcher on exactly the address it was given: torch's
TCPStore binds every interface unless handed a bound socket (``master_listen_fd``). Multi-tenant,
so torch's static rendezvous (same port, same process) reuses it.
"""

from __future__ import annotations

import datetime
import errno
import socket

import torch.distributed as dist

from ..errors import ConfigError, LaunchError
from ..world.reach import listening_socket


def bind_socket(addr: str, port: int) -> socket.socket:
    """A listening socket on ``addr:port`` (port 0: a free one); a ConfigError line where it cannot be."""
    try:
        return listening_socket(addr, port)
    except socket.gaierror as exc:
        raise ConfigError(f"--master-addr {addr} does not resolve ({exc.strerror}); give an IP address or a resolvable host name.") from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--master-port {port} is already in use on {addr}; choose another port, or omit --master-port on one node to pick a free one.") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"--master-addr {addr} is not an address of this host, but node 0 hosts the rendezvous there; run node 0 on {addr} or pass this host's address.") from None
        raise LaunchError(f"cannot listen on {addr}:{port}: {exc.strerror}.") from None


def host_store(addr: str, port: int, timeout_s: float = 900.0) -> tuple[dist.TCPStore, int]:
    """Start the rendezvous TCPStore server on ``addr:port``; returns it and the bound port."""
    sock = bind_socket(addr, port)
    bound_port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns (and closes) the socket from here on
    store = dist.TCPStore(
        addr,
        bound_port,
        None,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=fd,
    )
    return store, bound_port


def free_port(addr: str = "127.0.0.1") -> int:
    """A port that was free on ``addr`` a moment ago (for a launcher that binds it itself)."""
    sock = bind_socket(addr, 0)
    try:
        return sock.getsockname()[1]
    finally:
        sock.close()
