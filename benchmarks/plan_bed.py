"""The network test bed's own mechanics, which no user's cluster has, modelled for the bed's
validation only (benchmarks/plan_validation.py, benchmarks/zero1_broadcasts.py); `dtrain plan`
models the user's cluster.

The bed's hosts are network namespaces of one machine: every host's processes share its cores
(``on_bed``: a plan's compute phases slowed by the processes each core serves). Its gloo ZeRO
broadcasts between hosts run two trees at a time (``queued_broadcasts``), as measured by
benchmarks/zero1_broadcasts.py. Its shaper (tbf) passes a short transfer faster than a long one
(``SizedFigure``: each measured size at its own rate, and below the smallest the bucket's burst at
once; ``refilled_chain``: PowerSGD's three all-reduces one after another, the bucket refilling between
them), and queues a host's acknowledgements behind the data it sends, so the two directions of a
link take turns (``bed_makespan``: a pipeline's hand-offs that cross); `python3 benchmarks/plan_bed.py
plan ...` is `dtrain plan` with measured links read that way, PowerSGD's chain through the bucket and
the pipeline's crossing hand-offs taking turns (plan_validation.py runs it).
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from dtrain.plan import costs, steps
from dtrain.plan.cluster import Cluster
from dtrain.plan.costs import Figure, Group, broadcast, shape

COMPUTE = ("data", "forward", "backward", "optimizer", "bubble")
"""The phases of a plan's step that the bed's shared cores slow (the rest is the link's)."""


def slowdown(processes: int, cores: int, threads: int = 1) -> float:
    """How much slower each of ``processes`` computes on ``cores`` shared cores than the plan's
    profile, which had a core to itself: time slicing, at least 1."""
    return max(1.0, processes * threads / max(1, cores))


def on_bed(row: dict, processes: int, cores: int, threads: int = 1) -> dict:
    """A `dtrain plan --json` layout row as the bed runs it: the compute phases x ``slowdown``,
    the step time and samples/s recomputed from them."""
    k = slowdown(processes, cores, threads)
    if k == 1.0:
        return row
    phases = {p: v * k if p in COMPUTE else v for p, v in row["phases_ms"].items()}
    step = sum(phases.values())
    return {**row, "phases_ms": phases, "step_ms": step, "samples_per_s": row["samples_per_s"] * row["step_ms"] / step,
            "bed_slowdown": k}


@dataclass(frozen=True)
class SizedFigure(Figure):
    """A measured link whose rate depends on the size (the bed's shaper: 20 Mbit/s took 1 MiB at
    18.5 Mbit/s, 4 MiB at 15, and DDP's 548 KB all-reduce 231 ms where one rate put it at 314, bed
    run 8): ``by_size`` holds each measured size's own rate (bytes, bytes/s), ascending."""

    by_size: tuple[tuple[float, float], ...] = ()
    burst: float = 0.0
    """Bytes the shaper passes at once after the link idled (tbf's bucket: NetBed's ~2 ms at the rate, at
    least 16 KiB). PowerSGD's three all-reduces after backward (lm-20m: 31.7 KB in all) took 11.1 ms
    where the 1 MiB rate put them at 17.5 (benchmarks/plan_powersgd_bed.py, 2026-11-29): no user's
    link has it, so only the bed's plan counts it, below the smallest measured size."""

    def seconds(self, kind: str, nbytes: float, n: int, backend: str = "gloo") -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        steps, volume = shape(kind, backend)
        return steps(n) * self.lat + volume(n) * transfer(self, nbytes)

    def shared(self, k: float) -> SizedFigure:
        return SizedFigure(self.lat, self.bw / k, tuple((b, r / k) for b, r in self.by_size), self.burst / k)


def transfer(f: Figure, nbytes: float) -> float:
    """Seconds a unit of volume of ``nbytes`` takes beyond the latency: ``by_size``'s rates interpolated,
    the marginal rate beyond the largest size (a ``Figure`` without them: its bandwidth)."""
    pts = getattr(f, "by_size", ())
    if not pts:
        return nbytes / f.bw
    if nbytes <= pts[0][0]:  # the first burst bytes at once, the rest so that the smallest size takes its time
        size, rate = pts[0]
        burst = min(getattr(f, "burst", 0.0), size / 2)
        return max(0.0, nbytes - burst) * (size / rate) / (size - burst)
    for (s0, b0), (s1, b1) in zip(pts, pts[1:]):
        if nbytes <= s1:
            return nbytes / (b0 + (b1 - b0) * (nbytes - s0) / (s1 - s0))
    big, rate = pts[-1]
    return big / rate + (nbytes - big) / f.bw


def sized_fit(kind: str, seconds: dict[int, float], n: int, backend: str = "gloo", _fit=costs.fit) -> SizedFigure:
    """``costs.fit``, plus each size above the smallest at its own rate (its time beyond the latency)
    where that is above noise."""
    f = _fit(kind, seconds, n, backend)
    steps, volume = shape(kind, backend)
    by_size = tuple((b, volume(n) * b / (seconds[b] - steps(n) * f.lat)) for b in sorted(seconds)[1:]
                    if seconds[b] > 1.05 * steps(n) * f.lat)
    return SizedFigure(f.lat, f.bw, by_size, max(16 * 1024, 0.002 * f.bw) if by_size else 0.0)


def powersgd_calls(prof, rank: int) -> list[float]:  # noqa: ANN001
    """Elements of PowerSGD's three all-reduces in torch's order: the uncompressed rest, P (rows x rank
    of each matrix it compresses), Q (columns x rank); ``steps.powersgd_elements`` is their sum."""
    packed = [(m, n) for m, n in prof.matrices if m * n >= 2 * rank * (m + n)]
    rest = prof.params - sum(m * n for m, n in packed)
    return [rest, sum(rank * m for m, _ in packed), sum(rank * n for _, n in packed)]


def refilled_chain(sizes: Sequence[float], group: Group, c: Cluster) -> float:
    """Seconds for all-reduces of ``sizes`` bytes issued one after another on the bed, its shaper's bucket
    (``SizedFigure.burst``) full at the first (the link idled through backward) and refilled at the link's
    rate while each call's latency passes; the bytes beyond what it holds at the smallest measured size's
    rate. (``costs.allreduce`` of their sum counts the burst once: lm-20m's 31.7 KB took 6.8 ms of bytes in
    the plan; the bed passed P's 13.8 KB in about its latency and only part of Q's at the rate,
    benchmarks/plan_comm_parts.py.) Where the group is inside one host, or the link has no burst:
    ``costs.allreduce`` of each."""
    f = c.figure("all_reduce", group.nodes > 1, group.sharing)
    burst, n = getattr(f, "burst", 0.0), group.size
    if group.nodes <= 1 or n <= 1 or burst <= 0 or group.per_node > 1:
        return sum(costs.allreduce(b, group, c) for b in sizes)
    steps, volume = shape("all_reduce", c.backend)
    rate = f.by_size[0][1] if f.by_size else f.bw
    tokens, total = burst, 0.0
    for b in sizes:
        lat = steps(n) * f.lat
        tokens = min(burst, tokens + rate * lat)
        used = min(tokens, volume(n) * b)
        tokens -= used
        total += lat + (volume(n) * b - used) / rate
    return total


def bed_comm_cost(prof, c: Cluster, layout, s, bwd_window: float, nbytes: float, group: Group,  # noqa: ANN001
                  _real=steps.comm_cost) -> tuple[float, float, str | None]:
    """``steps.comm_cost`` with PowerSGD's three all-reduces played through the bed's bucket (``refilled_chain``)."""
    wire, exposed, note = _real(prof, c, layout, s, bwd_window, nbytes, group)
    if not layout.comm.startswith("powersgd"):
        return wire, exposed, note
    rank = int(layout.comm.partition(":")[2] or 2)
    chain = refilled_chain([4 * e / layout.dims.tp for e in powersgd_calls(prof, rank)], group, c)
    return chain, chain, note


CROSSED = 1.0
"""The share of its time by which a hand-off is slowed while one goes the other way on the bed: 1, the
two directions take turns. tbf queues up to 100 ms of a host's data and the acknowledgements of what it
receives behind it (no NIC at line rate does: `dtrain plan` gives each direction its own link).
benchmarks/pp_step_parts.py, lm-20m's 2-stage pipeline at 20 Mbit/s (2026-11-29): a gradient alone
21.3 ms, the activation fired with it 42.4 (the two one after another); p2p_duplex.py: 42.3 ms for
a 64 KiB send begun 1 ms after one the other way (26.9 alone). Faster links queue less: at 100 Mbit/s
that send took 7.5 ms (5.1 alone, a share of ~0.6), at 1 Gbit/s ~0 (2026-11-26); the validation's
pipeline runs at 20 Mbit/s (lm-20m)."""


@dataclass
class CrossingLink(steps._Link):
    """``steps._Link`` whose transfers take ``CROSSED`` x their overlap with the other direction's
    transfers longer (those played out before it); ``links``/``other``: its partner's index in them."""

    links: list = field(default_factory=list)
    other: int = -1
    spans: list = field(default_factory=list)

    def mark(self, side: dict[int, float], mb: int, at: float) -> None:
        done = mb in self.ends
        super().mark(side, mb, at)
        if done or mb not in self.ends or self.hop <= self.latency:
            return
        end = self.ends[mb] - min(self.latency, self.hop)  # its last byte leaves
        start = end - (self.hop - self.latency)
        more = CROSSED * sum(max(0.0, min(end, e) - max(start, s)) for s, e in self.links[self.other].spans)
        self.ends[mb] += more
        self.free = end + more
        self.spans.append((start, end + more))


def bed_makespan(p: int, m: int, fwd: float, bwd: float, hop: float, schedule: str = "1f1b", latency: float = 0.0,
                 _played=steps.makespan) -> float:
    """``steps.makespan`` with each pair of directions between neighbouring stages ``CrossingLink``s."""
    from unittest import mock

    links: list[CrossingLink] = []

    def link(h: float, lat: float = 0.0) -> CrossingLink:  # made act 0..p-2, then grad 0..p-2 (makespan's order)
        links.append(CrossingLink(h, lat, links=links, other=(len(links) + p - 1) % (2 * (p - 1))))
        return links[-1]
    with mock.patch.object(steps, "_Link", link):
        return _played(p, m, fwd, bwd, hop, schedule, latency)


def zero_partition(sizes: Sequence[float], n: int) -> list[list[float]]:
    """Each of ``n`` ranks' tensors (elements) under torch's ZeroRedundancyOptimizer partition:
    tensors largest first, each to the rank that holds least so far."""
    held, out = [0.0] * n, [[] for _ in range(n)]
    for k in sorted(sizes, reverse=True):
        r = held.index(min(held))
        out[r].append(k)
        held[r] += k
    return out


def zero_broadcasts(sizes: Sequence[float], n: int) -> list[tuple[int, float]]:
    """(owner, elements) of each broadcast torch's ZeroRedundancyOptimizer issues after its step, in
    its order: owner by owner, each owner's tensors as ``zero_partition`` gave them (largest first)."""
    return [(r, e) for r, mine in enumerate(zero_partition(sizes, n)) for e in mine]


def binomial_edges(n: int, root: int) -> list[tuple[int, int]]:
    """(sender, receiver) of gloo's broadcast from ``root`` to ``n`` ranks (``gloo::broadcast``):
    in virtual ranks (root 0), v receives from v less its highest set bit; a sender posts its sends
    to all its children at once, a forwarder once its own receive is in."""
    out = []
    for v in range(1, n):
        parent = v - (1 << (v.bit_length() - 1))
        out.append(((parent + root) % n, (v + root) % n))
    return out


GLOO_THREADS = 2
"""Collectives a gloo process group runs at once (``ProcessGroupGloo::Options``' default threads)."""
SIMULATED_RANKS = 16
"""Up to this many ranks ``queued_broadcasts`` plays the trees out; beyond, one after another."""


def queued_broadcasts(sends: Sequence[tuple[int, float]], group: Group, c: Cluster, *, messages: int = 1) -> float:
    """Seconds for broadcasts issued all at once and then waited for (ZeRO's parameter broadcasts,
    ``async_op``): ``sends`` (root rank in ``group``, bytes) in issue order.

    With NCCL they run one after another on the communicator's stream, and so they do inside one
    node (gloo over loopback: the CPU copies them; 2 processes took longer queued than waited) and
    beyond ``SIMULATED_RANKS``: ``broadcast`` of them all. Between nodes, gloo's worker threads run
    ``GLOO_THREADS`` of them at once, in issue order, each a binomial tree (``binomial_edges``);
    this plays them out: each transfer between two nodes goes at the link's rate split evenly
    among the transfers on its busiest resource (a node's sends, a node's receives, or a pair of
    ranks' one connection, whose two directions took turns on the bed: two hosts, two owners sending
    to each other, 440-477 ms where their bytes one after another take 429, in 6 runs of 10; in the
    other 4, 270-295); an edge inside a node is left out (loopback). The bed (``benchmarks/zero1_broadcasts.py``, 50 Mbit/s):
    the mlp's two large owners on 3 hosts overlap (550-679 ms, played out 514, one after another
    857), the LM's 38 small tensors, owned 13 by 13, do not (172, played out and serial 175).

    The latency: each tree waits for its receivers' "receive posted" notice and then its data to
    cross (a 64-byte broadcast: ``steps(n)`` x the figure's latency), and holds its worker thread
    that long, so the trees take at least ``ceil(trees / GLOO_THREADS)`` such waits; where the
    bytes take longer, the latency is paid ``messages`` times per tree round, as ``broadcast``'s
    (on an undelayed link the waits hide behind the other thread's bytes: bed run 11, a latency
    per tensor made lm-1g's zero1 +31.5%). Bed run 30, the LM on 3 hosts at 20 ms each way: 38
    trees of 14 KB took ~805 ms beyond ddp's step, 19 x the 42.6 ms 64-byte broadcast is 809, the
    bytes and a latency per owner 295."""
    n = group.size
    total = sum(b for _, b in sends)
    if n <= 1 or total <= 0:
        return 0.0
    if c.backend == "nccl" or group.nodes <= 1 or n > SIMULATED_RANKS:
        return broadcast(total, group, c, messages=messages)
    f = c.figure("broadcast", True, group.sharing)
    steps, _ = shape("broadcast", c.backend)
    busy = _play_trees(sends, n, group.per_node)
    by_bytes = max(1, messages) * steps(n) * f.lat + (transfer(f, busy) if busy > 0 else 0.0)
    trees = sum(1 for _, b in sends if b > 0)
    return max(by_bytes, math.ceil(trees / GLOO_THREADS) * steps(n) * f.lat)


def _play_trees(sends: Sequence[tuple[int, float]], n: int, per_node: int) -> float:
    """How long (in bytes at the link's rate) ``queued_broadcasts``' trees take, ``GLOO_THREADS``
    at a time: a fluid model, each transfer's rate 1 / the transfers on its busiest resource. A
    tree's transfers are its edges between nodes; one waits for its sender's own (if between nodes)."""
    queue = deque((root, b) for root, b in sends if b > 0)
    active: list[tuple[dict, dict]] = []  # per tree: {edge: bytes left}, {edge: the edge into its sender}
    t = 0.0
    while queue or active:
        while queue and len(active) < GLOO_THREADS:
            root, nbytes = queue.popleft()
            tree = binomial_edges(n, root)
            left = {e: nbytes for e in tree if e[0] // per_node != e[1] // per_node}
            if left:  # a tree inside nodes only takes no link time
                into = {b: (a, b) for a, b in tree}
                active.append((left, {e: into.get(e[0]) for e in left}))
        if not active:
            break
        ready = [(left, e) for left, after in active for e, more in left.items() if more > 0 and left.get(after[e], 0.0) <= 0]
        resources = {(id(left), e): (("out", e[0] // per_node), ("in", e[1] // per_node), ("pair", min(e), max(e)))
                     for left, e in ready}
        users: dict[tuple, int] = {}
        for keys in resources.values():
            for key in keys:
                users[key] = users.get(key, 0) + 1
        rate = {k: 1.0 / max(users[key] for key in keys) for k, keys in resources.items()}
        dt = min(left[e] / rate[(id(left), e)] for left, e in ready)
        t += dt
        for left, e in ready:
            more = left[e] - dt * rate[(id(left), e)]
            left[e] = 0.0 if more <= 1e-9 * (1 + dt) else more
        active = [(left, after) for left, after in active if any(v > 0 for v in left.values())]
    return t


if __name__ == "__main__":  # `dtrain plan` with the bed's measured links read size by size
    from unittest import mock

    from dtrain.cli import main

    with mock.patch.object(costs, "fit", sized_fit), mock.patch.object(steps, "makespan", bed_makespan), \
            mock.patch.object(steps, "comm_cost", bed_comm_cost):
        sys.exit(main(sys.argv[1:]))
