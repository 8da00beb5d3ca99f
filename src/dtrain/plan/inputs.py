"""What a user hands `dtrain plan` about the machines (flags, a ``--cluster`` or ``--links`` file),
checked where it enters: each mistake one ``ConfigError`` line (what, the value, the fix)."""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

MAX_WORLD = 1 << 18  # processes (262,144): beyond the largest clusters
MAX_PROCS_PER_NODE = 1024
MAX_FILE_BYTES = 1 << 20  # a cluster or links file is a few hundred bytes


@dataclass(frozen=True)
class Bound:
    """One setting: its type, its range (inclusive), and how a user writes it."""

    kind: type
    noun: str = ""
    low: float = 0
    high: float = 0
    unit: str = ""
    example: str = ""
    flag: str | None = None


SETTINGS: dict[str, Bound] = {
    "device": Bound(str, "the device", example='"h100"', flag="--device"),
    "nodes": Bound(int, "the number of nodes", 1, MAX_WORLD, "", "4", "--nnodes"),
    "procs_per_node": Bound(int, "processes per node", 1, MAX_PROCS_PER_NODE, "", "8", "-n"),
    "peak_tflops": Bound(float, "the device's peak", 1e-3, 1e5, "TFLOP/s", "989", "--peak-tflops"),
    "achieved_fraction": Bound(float, "the fraction of the peak a step reaches", 1e-4, 1, "", "0.4", "--mfu"),
    "memory_gib": Bound(float, "memory per device", 1e-3, 1e5, "GiB", "80", "--mem-gib"),
    "mem_bw_gbytes_per_s": Bound(float, "memory bandwidth", 1e-3, 1e6, "GB/s", "3350"),
    "intra_gbit": Bound(float, "the bandwidth inside a node", 1e-3, 1e6, "Gbit/s", "3600", "--intra-gbit"),
    "inter_gbit": Bound(float, "the bandwidth between nodes", 1e-3, 1e6, "Gbit/s", "3200", "--inter-gbit"),
    "intra_latency_us": Bound(float, "the latency per message inside a node", 1e-2, 1e6, "us", "5", "--intra-latency-us"),
    "inter_latency_us": Bound(float, "the latency per message between nodes", 1e-2, 1e6, "us", "10", "--inter-latency-us"),
    "tree": Bound(bool, "whether all-reduces may use a tree", example="true"),
}
"""The cluster's settings (a ``--cluster`` file's keys; most of them flags too)."""


def shown(value: Any, *, flag: bool = False) -> str:
    """A value as the user wrote it, short; a word for a container (never expanded: YAML aliases)."""
    if isinstance(value, float):
        text = repr(value)  # a file's 4.0 where a whole number goes; a flag's -5 as typed
        return text[:-2] if flag and text.endswith(".0") else text
    if isinstance(value, (dict, list, tuple, set)):
        return {dict: "an object", list: "a list"}.get(type(value), f"a {type(value).__name__}")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return "a number of more than 30 digits"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _num(x: float) -> str:
    return f"{int(x):,}" if x == int(x) and abs(x) < 1e15 else f"{x:g}"


def _rule(b: Bound) -> str:
    what = "a whole number" if b.kind is int else "a number"
    return f"{b.noun} must be {what} from {_num(b.low)} to {_num(b.high)}{' ' + b.unit if b.unit else ''}"


def check(b: Bound, value: Any, what: str, fix: str, *, flag: bool = False) -> Any:
    """``value`` if of ``b``'s type (a bool is no number), finite and in range; else one line."""
    if b.kind is bool or b.kind is str:
        if not isinstance(value, b.kind):
            need = "true or false" if b.kind is bool else "a name in quotes"
            raise ConfigError(f"{what} is {shown(value)}, not {need}; {fix}.")
        if b.kind is str and not 0 < len(value) <= 64:
            raise ConfigError(f"{what} {shown(value)} is not a name; {fix}.")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (b.kind is int and not isinstance(value, int)):
        raise ConfigError(f"{what} is {shown(value)}: {_rule(b)}; {fix}.")
    if isinstance(value, float) and not math.isfinite(value) or not b.low <= value <= b.high:
        raise ConfigError(f"{what} {shown(value, flag=flag)}: {_rule(b)}; {fix}.")
    return b.kind(value)


def cluster_settings(raw: dict[Any, Any], where: str | None = None) -> dict[str, Any]:
    """``raw`` checked: a ``--cluster`` file's (``where``) or the flags' (``where`` None; None values left out)."""
    unknown = sorted(shown(k) for k in raw if k not in SETTINGS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(SETTINGS)}.")
    out = {}
    for key, value in raw.items():
        b = SETTINGS[key]
        if where is not None:
            out[key] = check(b, value, f'{where}: "{key}"', f'e.g. "{key}": {b.example}')
        elif value is not None:
            out[key] = check(b, value, b.flag or key, f"e.g. {b.flag} {b.example.strip(chr(34))}", flag=True)
    return out


def world(nodes: int, procs_per_node: int) -> int:
    """The job's processes, at most ``MAX_WORLD``."""
    if nodes * procs_per_node > MAX_WORLD:
        raise ConfigError(f"{nodes:,} node(s) x {procs_per_node:,} process(es) is {nodes * procs_per_node:,} processes; a plan is "
                          f"for at most {MAX_WORLD:,} (lower --nnodes or -n).")
    return nodes * procs_per_node


def read_text(what: str, path: str, fix: str, limit: int = MAX_FILE_BYTES) -> str:
    """The text of ``path``, a small regular UTF-8 file; a FIFO, device or folder refused without blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} cannot be read ({getattr(exc, 'strerror', None) or exc}); {fix}.") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a named pipe" if stat.S_ISFIFO(mode) else "a device or socket"
            raise ConfigError(f"{what} is {kind}, not a regular file; {fix}.")
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(f"{what} cannot be read ({exc.strerror}); {fix}.") from None
    finally:
        os.close(fd)
    if size > limit:
        raise ConfigError(f"{what} is larger than {limit >> 10} KiB, too large for what it holds; {fix}.")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} is not a text file (byte {exc.start} is not UTF-8); {fix}.") from None


def parse(what: str, text: str, fix: str, *, yaml: bool = False) -> Any:
    """JSON (or YAML) ``text``; a syntax error, a huge number or deep nesting is one line."""
    if yaml:
        try:
            import yaml as pyyaml
        except ImportError:
            raise ConfigError(f"{what} is YAML but PyYAML is not installed; pip install pyyaml, or write JSON.") from None
        try:
            return pyyaml.safe_load(text)
        except pyyaml.YAMLError as exc:
            where = f"line {exc.problem_mark.line + 1}: " if getattr(exc, "problem_mark", None) is not None else ""
            problem = str(getattr(exc, "problem", None) or type(exc).__name__).replace("\n", " ")
            raise ConfigError(f"{what} is not valid YAML ({where}{problem}); {fix}.") from None
        except (RecursionError, ValueError, TypeError) as exc:
            raise ConfigError(f"{what} cannot be read as YAML ({_why(exc)}); {fix}.") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} is not valid JSON (line {exc.lineno}: {exc.msg}); {fix}.") from None
    except (RecursionError, ValueError) as exc:
        raise ConfigError(f"{what} cannot be read as JSON ({_why(exc)}); {fix}.") from None


def _why(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    text = str(exc).split("\n")[0]
    return "a number of more digits than Python converts" if "integer string conversion" in text else text[:120]
