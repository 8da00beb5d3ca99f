"""Checks of a user's input where it enters dtrain (flags, ``dtrain.init``, ``Context`` methods).

Each check raises one ``ConfigError`` line: what, the value, the fix. They are plain functions so
argparse types, the config dataclasses' ``__post_init__`` and the public API share them.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import socket
import sys
from typing import Any

from .errors import ConfigError


def type_name(value: Any) -> str:
    return type(value).__name__


def instance(what: str, value: Any, types: type | tuple[type, ...], fix: str) -> Any:
    """``value`` if it is one of ``types`` (a bool is not an int here), else ConfigError."""
    bad_bool = isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,))
    if not isinstance(value, types) or bad_bool:
        raise ConfigError(f"{what} got {type_name(value)} {short(value)}; {fix}.")
    return value


def integer(what: str, value: Any, *, minimum: int | None = None) -> int:
    """An int (not a bool, not a float), at least ``minimum``."""
    instance(what, value, int, "give an int")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{what} must be >= {minimum}, got {value}.")
    return value


def seed(what: str, value: Any) -> int:
    """A random seed torch accepts: an int in -2**63 .. 2**64-1."""
    integer(what, value)
    if not -(2**63) <= value < 2**64:
        raise ConfigError(f"{what} {value} is outside the seeds torch takes (-2**63 .. 2**64-1); use e.g. 0 or 1234.")
    return value


def number(what: str, value: Any, *, positive: bool = False) -> float:
    """A finite real number (an int or float, not a bool or a string), >= 0; > 0 when ``positive``."""
    instance(what, value, (int, float), "give a number")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite number, got {value}.")
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"{what} must be {'> 0' if positive else '>= 0'}, got {value:g}.")
    return value


def seconds(what: str, value: Any) -> float:
    """A finite duration > 0."""
    return number(what, value, positive=True)


MIN_STARTUP_S = 1.0
"""The smallest start-up bound: torch counts the rendezvous' timeouts in whole seconds, so a bound
below a second ends waits before any connection could be made."""


def startup_seconds(what: str, value: Any) -> float:
    """A start-up bound (``--startup-timeout``, ``--rdzv-timeout``): finite, at least ``MIN_STARTUP_S``."""
    instance(what, value, (int, float), "give a number of seconds")
    if not (math.isfinite(value) and value >= MIN_STARTUP_S):
        raise ConfigError(f"{what} must be a finite number of seconds >= {MIN_STARTUP_S:g}, got {value:g}; give the seconds "
                          "each start-up wait may take, e.g. 120 (the default).")
    return float(value)


def output_file(what: str, path: str) -> str:
    """A file dtrain will write (creating its folders): not a folder, not under a file, writable."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{what} needs a file path, got {path!r}.")
    if os.path.isdir(path):
        raise ConfigError(f"{what} {path} is a folder; give a file path (e.g. {os.path.join(path, 'out.jsonl')}).")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{what} {path} is not writable by this user; pick another path.")
    _creatable(what, path, os.path.dirname(os.path.abspath(path)))
    return path


def output_dir(what: str, path: str) -> str:
    """A folder dtrain will write into (creating it): not a file, not under a file, writable."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{what} needs a folder path, got {path!r}.")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{what} {path} is a file, not a folder; give a folder path.")
    _creatable(what, path, os.path.abspath(path))
    return path


def _creatable(what: str, path: str, folder: str) -> None:
    """The nearest existing ancestor of ``folder`` is a folder this process can create files in."""
    probe = folder
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"{what} {path}: {probe} is a file, not a folder; give a path under a folder.")
    problem = write_probe(probe)
    if problem is not None:
        raise ConfigError(f"{what} {path}: folder {probe} is not writable ({problem}); pick another path.")


def write_probe(folder: str) -> str | None:
    """Why no file can be created in the existing ``folder`` (None: one can); tried by creating one,
    since ``os.access`` says yes to root for /proc and for a read-only mount."""
    import tempfile

    if not os.access(folder, os.W_OK | os.X_OK):
        return "no write permission for this user"
    try:
        fd, name = tempfile.mkstemp(prefix=".dtrain-write-probe-", dir=folder)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


def make_dir(what: str, folder: str, flag: str, error: type[Exception] = ConfigError) -> str:
    """Create the folder ``flag`` names (``what``: how errors name it) and check that files can be
    created in it: one line now rather than a traceback after training started."""
    if not isinstance(folder, str) or not folder:
        raise error(f"{flag} needs a folder path, got {folder!r}.")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise error(f"{what} {folder} is a file, not a folder; give a folder path to {flag}.")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise error(f"cannot create {what} {folder}: {exc.strerror or exc}; choose a writable {flag}.") from None
    problem = write_probe(folder)
    if problem is not None:
        raise error(f"{what} {folder} is not writable ({problem}); choose a writable {flag}.")
    return folder


_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")


def host(what: str, addr: str) -> str:
    """A host name or IP address that resolves (a bad one otherwise fails after the rendezvous timeout)."""
    if not isinstance(addr, str) or not addr.strip():
        raise ConfigError(f"{what} is empty; give the address of node 0 (e.g. 10.0.0.1 or node001).")
    bare = addr[1:-1] if addr.startswith("[") and addr.endswith("]") else addr
    if not (_HOST.match(bare) or _is_ip(bare)):
        raise ConfigError(f"{what} {addr!r} is not a host name or IP address; give e.g. 10.0.0.1 or node001.")
    try:
        socket.getaddrinfo(bare, None)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"{what} {addr!r} does not resolve ({exc.args[-1] if exc.args else exc}); check the name, or give node 0's IP address.") from None
    return addr


def _is_ip(text: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, text)
            return True
        except (OSError, ValueError):
            pass
    return False


def short(value: Any) -> str:
    """``value`` as Python writes it (a line break as ``\\n``: a message stays one line), cut to 60 characters."""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return text.replace("\n", " ")  # some objects' repr spans lines (an array's)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2, and flags are never abbreviated."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"dtrain: error: {message}; see `{self.prog} --help`.", file=sys.stderr)
        sys.exit(2)
