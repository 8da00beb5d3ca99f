"""What a collective costs on a group of ranks: ``steps(n) x latency + volume(n) x bytes / bandwidth``
(``SHAPES``; a ``Figure`` from a preset or measured between real processes, ``Links``). Ring and tree
all-reduce (Thakur, Rabenseifner & Gropp 2005; NCCL picks the cheaper); across nodes hierarchical:
reduce-scatter in each node, all-reduce the shards between nodes over its NICs, all-gather in each node."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..diag.probe import LINK_SIZES, time_collectives
from ..errors import ConfigError
from . import inputs

SHAPES = {
    "all_reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "all_gather": (lambda n: n - 1, lambda n: (n - 1) / n),
    "reduce_scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
    # gloo's broadcast: a binomial tree, each of its ceil(log2 n) rounds sending the whole tensor
    "broadcast": (lambda n: math.ceil(math.log2(n)), lambda n: math.ceil(math.log2(n))),
    "send_recv": (lambda n: 1, lambda n: 1),
}
"""(steps(n), volume(n)) of each collective: latencies paid and bytes / bandwidth moved."""
NCCL_BROADCAST = (lambda n: n - 1, lambda n: 1)  # a pipelined ring: each byte crosses one link once


def shape(kind: str, backend: str = "gloo") -> tuple:
    return NCCL_BROADCAST if kind == "broadcast" and backend == "nccl" else SHAPES[kind]


@dataclass(frozen=True)
class Figure:
    """One collective's ``lat`` seconds a step and ``bw`` bytes/s."""

    lat: float
    bw: float

    def seconds(self, kind: str, nbytes: float, n: int, backend: str = "gloo") -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        steps, volume = shape(kind, backend)
        return steps(n) * self.lat + volume(n) * nbytes / self.bw

    def shared(self, k: float) -> Figure:
        """With ``k`` groups sending through the same NICs at once."""
        return Figure(self.lat, self.bw / k)


@dataclass(frozen=True, kw_only=True)
class Links:
    """What was measured between ``ranks`` processes (``between``: ``processes`` of one node or ``nodes``)."""

    between: str
    ranks: int
    backend: str
    figures: dict[str, Figure]
    seconds: dict[str, dict[int, float]] = field(default_factory=dict)  # the measurements: kind -> bytes -> median seconds
    load: float | None = None  # the machine's load average when measured
    device: str = "cpu"  # what the ranks' tensors were on: ``cpu`` (gloo) or ``cuda`` (nccl)

    def describe(self) -> dict[str, Any]:
        return {"between": self.between, "ranks": self.ranks, "backend": self.backend, "device": self.device, "load": self.load,
                "figures": {k: {"latency_us": round(f.lat * 1e6, 1), "gbit_per_s": round(f.bw * 8 / 1e9, 4)}
                            for k, f in self.figures.items()}}


def fit(kind: str, seconds: dict[int, float], n: int, backend: str = "gloo") -> Figure:
    """A ``Figure`` from one collective's median times by size on ``n`` ranks: the latency the smallest
    size's time over its steps, the bandwidth the two largest sizes' extra bytes over their extra time."""
    sizes = sorted(seconds)
    if n < 2 or len(sizes) < 2:
        raise ConfigError(f"links: {kind} needs times at >= 2 sizes between >= 2 ranks, got {len(sizes)} size(s) on {n}.")
    steps, volume = shape(kind, backend)
    lat = seconds[sizes[0]] / max(1, steps(n))
    big, mid = sizes[-1], sizes[-2]
    if (extra := seconds[big] - seconds[mid]) <= 0:  # noise swamped the difference: take the largest size's own time beyond the latency
        extra = max(seconds[big] - steps(n) * lat, 1e-9)
        mid = 0
    return Figure(lat=lat, bw=volume(n) * (big - mid) / extra)


def from_measurement(seconds: dict[str, dict[int, float]], *, ranks: int, between: str, backend: str,
                     load: float | None = None, device: str | None = None) -> Links:
    figures = {kind: fit(kind, by_size, ranks, backend) for kind, by_size in seconds.items() if kind in SHAPES}
    return Links(between=between, ranks=ranks, backend=backend, figures=figures, seconds=seconds, load=load,
                 device=device or ("cuda" if backend == "nccl" else "cpu"))  # where dtrain's probe runs each


_FIX = "write it with `dtrain doctor --links-out FILE`"
_SECONDS = inputs.Bound(float, "a measured time", 1e-9, 3600, "seconds", "0.0016")
_SIZE = inputs.Bound(int, "a size", 1, 1 << 40, "bytes", "1048576")
_RANKS = inputs.Bound(int, "the ranks measured", 2, inputs.MAX_WORLD, "", "2")
_LOAD = inputs.Bound(float, "the load average", 0, 1e6, "", "1.5")


def from_record(record: dict[str, Any], source: str = "links") -> Links:
    """A ``Links`` from what ``dtrain doctor --links-out`` wrote, each field checked: one line for what is wrong."""
    def choice(key: str, means: str, choices: tuple[str, ...], default: str | None = None) -> str:
        value = record.get(key, default)
        if not isinstance(value, str) or value not in choices:
            said = "is missing" if value is None else f"is {inputs.shown(value)}"
            raise ConfigError(f"{source}: \"{key}\" {said}; a link measurement is {means} {' or '.join(map(repr, choices))} ({_FIX}).")
        return value

    between = choice("between", "between", ("processes", "nodes"))
    ranks = inputs.check(_RANKS, record.get("ranks"), f'{source}: "ranks"', _FIX)
    backend = choice("backend", "made with", ("gloo", "nccl"), "gloo")
    device = choice("device", "on", ("cpu", "cuda"), "cuda" if backend == "nccl" else "cpu")  # older files: as the probe paired them
    load = None if record.get("load") is None else inputs.check(_LOAD, record["load"], f'{source}: "load"', _FIX)
    return from_measurement(_seconds(record.get("seconds"), source), ranks=ranks, between=between, backend=backend,
                            load=load, device=device)


def _seconds(raw: Any, source: str) -> dict[str, dict[int, float]]:
    """``seconds``: collective -> size in bytes (a decimal string) -> median seconds, two sizes at least."""
    if not isinstance(raw, dict) or not raw:
        said = "is missing" if raw is None else f"is {inputs.shown(raw)}" if raw else "is empty"
        raise ConfigError(f"{source}: \"seconds\" {said}; it holds each collective's times by size ({_FIX}).")
    out: dict[str, dict[int, float]] = {}
    for kind, times in raw.items():
        what = f"{source}: seconds[{inputs.shown(kind)}]"
        if not isinstance(times, dict) or len(times) < (2 if kind in SHAPES else 1):
            said = f"has {len(times)} size" if isinstance(times, dict) else f"is {inputs.shown(times)}"
            raise ConfigError(f"{what} {said}; it holds the times by size in bytes, two sizes at "
                              f"least, e.g. {{\"64\": 0.0016, \"1048576\": 0.009}} ({_FIX}).")
        out[kind] = {}
        for size, secs in times.items():
            if not (isinstance(size, str) and size.isascii() and size.isdigit() and len(size) < 16):
                raise ConfigError(f"{what}: size {inputs.shown(size)} is not a number of bytes such as \"1048576\" ({_FIX}).")
            nbytes = inputs.check(_SIZE, int(size), f"{what}: size", _FIX)
            out[kind][nbytes] = inputs.check(_SECONDS, secs, f'{what}["{size}"]', _FIX)
    return out


def load(path: str) -> Links:
    """A link measurement written by ``dtrain doctor --links-out`` (JSON; a small regular file)."""
    what, fix = f"--links {path!r}", f"write one with `dtrain doctor --links-out {path}`"
    record = inputs.parse(what, inputs.read_text(what, path, fix), fix)
    if not isinstance(record, dict):
        raise ConfigError(f"{what} holds {inputs.shown(record)}, not one JSON object as `dtrain doctor --links-out` writes.")
    return from_record(record, what)


def measure_body(sizes: tuple[int, ...], reps: int) -> dict[str, dict[int, float]]:
    """Collective: every rank. The probe between local processes (``dtrain plan --measure-links``)."""
    dist.init_process_group("gloo")
    try:
        return time_collectives(torch.device("cpu"), sizes, reps)
    finally:
        dist.destroy_process_group()


def measure_local(ranks: int = 2, reps: int = 3) -> Links:
    """Time the collectives between ``ranks`` fresh processes on this machine (gloo, CPU)."""
    from ..launch.local import run_distributed

    seconds = run_distributed(measure_body, LINK_SIZES, reps, world_size=ranks, timeout=300)[0]
    return from_measurement(seconds, ranks=ranks, between="processes", backend="gloo", load=os.getloadavg()[0])


@dataclass(frozen=True)
class Group:
    """A process group: ``nodes`` nodes with ``per_node`` members each."""

    nodes: int
    per_node: int
    sharing: int = 1  # groups like it sending through the same node's NICs at once (hsdp's replicas, tp x dp's dp groups)

    @property
    def size(self) -> int:
        return self.nodes * self.per_node


def group_of(size: int, stride: int, procs_per_node: int) -> Group:
    """The group of ``size`` ranks ``stride`` apart (a mesh dimension; ranks numbered node by node)."""
    if size <= 1:
        return Group(1, 1)
    if stride >= procs_per_node:
        return Group(size, 1, procs_per_node)
    per_node = max(1, min(size, procs_per_node // stride))
    nodes = max(1, math.ceil(size / per_node))
    return Group(nodes, per_node, max(1, procs_per_node // per_node) if nodes > 1 else 1)


# below, ``c`` is a cluster.Cluster (not imported: cluster.py imports this module)
def tree_allreduce(nbytes: float, n: int, bw: float, lat: float) -> float:
    return 0.0 if n <= 1 or nbytes <= 0 else 2 * math.ceil(math.log2(n)) * lat + 2 * nbytes / bw


def _flat(kind: str, nbytes: float, n: int, c: Any, crossing: bool, sharing: int = 1) -> float:
    f = c.figure(kind, crossing, sharing)
    t = f.seconds(kind, nbytes, n, c.backend)
    return min(t, tree_allreduce(nbytes, n, f.bw, f.lat)) if kind == "all_reduce" and c.tree else t


def _nodes(kind: str, nbytes: float, group: Group, c: Any, inside: tuple[str, ...]) -> float:
    """``kind`` in one node; across nodes each member moves 1/per_node of the data between nodes, in
    parallel over the node's NICs, plus ``inside`` in its node."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if group.nodes == 1:
        return _flat(kind, nbytes, group.per_node, c, False)
    inter = _flat(kind, nbytes, group.nodes, c, True, group.sharing)
    return inter if group.per_node == 1 else sum(_flat(k, nbytes, group.per_node, c, False) for k in inside) + inter


def allreduce(nbytes: float, group: Group, c: Any) -> float:
    """Seconds for an all-reduce of ``nbytes`` on ``group`` (across nodes: reduce-scatter, all-reduce, all-gather)."""
    return _nodes("all_reduce", nbytes, group, c, ("reduce_scatter", "all_gather"))


def gather(nbytes: float, group: Group, c: Any, *, reduce: bool = False) -> float:
    """Seconds for an all-gather (``reduce``: a reduce-scatter) whose full result is ``nbytes``."""
    if reduce and group.size > 1 and _reduce_is_allreduce(group, c):
        return allreduce(nbytes, group, c)
    kind = "reduce_scatter" if reduce else "all_gather"
    return _nodes(kind, nbytes, group, c, (kind,))


def _reduce_is_allreduce(group: Group, c: Any) -> bool:
    """torch's gloo backend has no reduce-scatter of its own: it all-reduces (unless one was measured)."""
    measured = c.links.get("inter" if group.nodes > 1 else "intra")
    return c.backend == "gloo" and (measured is None or "reduce_scatter" not in measured.figures)


def broadcast(nbytes: float, group: Group, c: Any, *, messages: int = 1) -> float:
    """Seconds for broadcasts of ``nbytes`` in all to ``group``, queued: the latency paid ``messages`` times."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    f = c.figure("broadcast", group.nodes > 1, group.sharing)
    steps, _ = shape("broadcast", c.backend)
    return f.seconds("broadcast", nbytes, group.size, c.backend) + (max(1, messages) - 1) * steps(group.size) * f.lat


def p2p(nbytes: float, group: Group, c: Any) -> float:
    """One send from a rank to its neighbour in ``group`` (pipeline stages)."""
    return 0.0 if nbytes <= 0 else _flat("send_recv", nbytes, 2, c, group.nodes > 1, group.sharing if group.nodes > 1 else 1)
