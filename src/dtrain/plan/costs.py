"""What one collective costs on a group of ranks: the alpha-beta model (Hockney), ring and tree
algorithms (Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations
in MPICH", 2005), hierarchical across nodes.

Ring all-reduce of B bytes over n ranks: a reduce-scatter then an all-gather, each n-1 steps of
B/n bytes: ``2(n-1) * lat + 2(n-1)/n * B / bw``. A tree (NCCL's double binary tree) needs
~``2 log2(n)`` latencies and ~``2 B / bw``; NCCL picks the cheaper, so the model does too
when the cluster has ``tree``. A group spanning nodes does a reduce-scatter inside each node,
an all-reduce of the shards between nodes (carried by the node's NICs together), and an
all-gather inside each node.

Each collective's latency and bandwidth come from ``Cluster.figure``: measured between real
processes where the cluster has a link measurement for that collective (``links``), else the
cluster's described bandwidth and latency.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .cluster import Cluster
from .links import Links, shape

_NONE = Links(between="processes", ranks=0, backend="", figures={})


@dataclass(frozen=True)
class Group:
    """A process group: ``nodes`` nodes with ``per_node`` members each."""

    nodes: int
    per_node: int
    sharing: int = 1
    """Groups like it that send through the same node's NICs at once (hsdp's replicas, the dp
    groups of a tp x dp layout): each gets 1/sharing of the node's bandwidth between nodes."""

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


def tree_allreduce(nbytes: float, n: int, bw: float, lat: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * lat + 2 * nbytes / bw


def _flat_allreduce(nbytes: float, n: int, c: Cluster, crossing: bool, sharing: int = 1) -> float:
    f = c.figure("all_reduce", crossing, sharing)
    ring = f.seconds("all_reduce", nbytes, n, c.backend)
    return min(ring, tree_allreduce(nbytes, n, f.bw, f.lat)) if c.tree else ring


def _flat(kind: str, nbytes: float, n: int, c: Cluster, crossing: bool, sharing: int = 1) -> float:
    return c.figure(kind, crossing, sharing).seconds(kind, nbytes, n, c.backend)


def allreduce(nbytes: float, group: Group, c: Cluster) -> float:
    """Seconds for an all-reduce of ``nbytes`` on ``group``."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if group.nodes == 1:
        return _flat_allreduce(nbytes, group.per_node, c, False)
    inter = _flat_allreduce(nbytes, group.nodes, c, True, group.sharing)
    if group.per_node == 1:
        return inter
    # Each of the node's members all-reduces 1/per_node of the data between nodes, in parallel,
    # over the node's NICs together: the node still sends ~2(N-1)/N x nbytes.
    intra = _flat("reduce_scatter", nbytes, group.per_node, c, False) + _flat("all_gather", nbytes, group.per_node, c, False)
    return intra + inter


def allreduce_after_idle(nbytes: float, group: Group, c: Cluster) -> float:
    """Seconds for an all-reduce of ``nbytes`` on ``group`` issued after the link sat idle (a
    step's compute): ``allreduce`` less its ``idle_saving``."""
    cost = lambda x: allreduce(x, group, c)  # noqa: E731
    return cost(nbytes) - idle_saving(cost, "all_reduce", nbytes, group, c)


def idle_saving(cost: Callable[[float], float], kind: str, nbytes: float, group: Group, c: Cluster) -> float:
    """Seconds a collective ``kind`` of ``nbytes`` (``cost``: its seconds for a size) takes less when
    it starts on a link that sat idle long enough: each rank's first ``burst_bytes`` go at once, the
    rest at the link's rate; the latency is paid in full. After a shorter idle gap a token bucket
    has refilled less: ``LinkClock`` takes ``min(gap, this)``."""
    burst = burst_bytes(group, c)
    if burst <= 0 or nbytes <= 0 or group.size <= 1:
        return 0.0
    _, volume = shape(kind, c.backend)
    n = group.nodes if group.nodes > 1 else group.per_node
    return max(0.0, cost(nbytes) - cost(max(4.0, nbytes - burst / max(1e-9, volume(n)))))


def crossed_link(group: Group, c: Cluster) -> Links | None:
    """The measured link ``group``'s traffic crosses (between nodes where it spans them), or None."""
    return c.links.get("inter" if group.nodes > 1 else "intra")


def burst_bytes(group: Group, c: Cluster) -> float:
    """What the link ``group`` crosses lets through at once after idle time; 0 where not measured."""
    if group.size <= 1:
        return 0.0
    measured = crossed_link(group, c)
    return measured.burst() if measured is not None else 0.0


def gather(nbytes: float, group: Group, c: Cluster, *, reduce: bool = False) -> float:
    """Seconds for an all-gather (``reduce``: a reduce-scatter) whose full result is ``nbytes``."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    kind = "reduce_scatter" if reduce else "all_gather"
    crossing = group.nodes > 1
    if reduce and gather_kind(group, c, reduce) == "all_reduce":
        return allreduce(nbytes, group, c)
    if not crossing:
        return _flat(kind, nbytes, group.per_node, c, False)
    inter = _flat(kind, nbytes, group.nodes, c, True, group.sharing)
    if group.per_node == 1:
        return inter
    # Between nodes each member moves 1/per_node of the data (the NICs in parallel); then each
    # gathers the rest from its node's members.
    return inter + _flat(kind, nbytes, group.per_node, c, False)


def gather_kind(group: Group, c: Cluster, reduce: bool) -> str:
    """The collective ``gather`` prices: torch's gloo backend reduce-scatters by all-reducing (on
    the test bed, 2 hosts at 20 Mbit/s, a 1 MiB reduce_scatter_tensor took 487-568 ms, its
    all_reduce 441-449 ms), so there a reduce-scatter is an all-reduce unless one was measured."""
    if not reduce:
        return "all_gather"
    if c.backend == "gloo" and "reduce_scatter" not in (crossed_link(group, c) or _NONE).figures:
        return "all_reduce"
    return "reduce_scatter"


def broadcast(nbytes: float, group: Group, c: Cluster, *, messages: int = 1) -> float:
    """Seconds for broadcasts of ``nbytes`` in all to ``group``, one after another, paying the
    link's latency ``messages`` times (each broadcast waited for: one per broadcast; queued ones
    that are all issued before any is waited for: one per sending rank)."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    f = c.figure("broadcast", group.nodes > 1, group.sharing)
    steps, _ = shape("broadcast", c.backend)
    return f.seconds("broadcast", nbytes, group.size, c.backend) + (max(1, messages) - 1) * steps(group.size) * f.lat


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
    by_bytes = max(1, messages) * steps(n) * f.lat + (f.transfer(busy) if busy > 0 else 0.0)
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


def p2p(nbytes: float, group: Group, c: Cluster) -> float:
    """One send from a rank to its neighbour in ``group`` (pipeline stages)."""
    if nbytes <= 0:
        return 0.0
    return _flat("send_recv", nbytes, 2, c, group.nodes > 1, group.sharing if group.nodes > 1 else 1)


def paced_p2p(nbytes: float, group: Group, c: Cluster) -> float | None:
    """One send of ``nbytes`` to a neighbour on a connection that carries only such sends (a
    pipeline's), where the measured link paced those (``links.Links.paced``): its latency, the
    probe's size of it at the paced rate, the rest at the link's (a larger send is not measured:
    the sender's estimate would grow with it); never less than ``p2p``. None where not paced."""
    measured = crossed_link(group, c)
    got = measured.paced() if measured is not None else None
    if got is None or nbytes <= 0:
        return None
    size, rate = got
    first = min(nbytes, size)
    return max(p2p(nbytes, group, c), p2p(1, group, c) + first / rate + p2p(nbytes, group, c) - p2p(first, group, c))


def crossing(nbytes: float, group: Group, c: Cluster) -> float:
    """How much of its time a send of ``nbytes`` between neighbours in ``group`` is slowed while one
    goes the other way, as measured on the link (``links.Links.crossing``); 0 where not measured."""
    measured = crossed_link(group, c)
    return measured.crossing(nbytes) if measured is not None else 0.0


@dataclass
class LinkClock:
    """One link serving transfers one after another in the order they are issued. A token bucket
    refills while the link sits idle: a transfer that starts g seconds after the last one ended takes
    ``min(g, save)`` less (``save``: its ``idle_saving``). ``costs`` does not know what is issued
    when; ``steps.ddp_sync`` (DDP's buckets), ``steps.pipelined`` (FSDP's gathers and scatters) and
    ``pipeline_sim`` (a pipeline's sends) each play their order out on one of these."""

    free: float = 0.0
    """When the link is next free."""
    last: float = -math.inf
    """When its last transfer ended (-inf: it has sat idle forever)."""
    wire: float = 0.0
    """Seconds it has spent sending."""

    @classmethod
    def idle_for(cls, seconds: float) -> LinkClock:
        """A link that has sat idle for ``seconds`` at time 0."""
        return cls(last=-seconds)

    def send(self, at: float, seconds: float, save: float = 0.0) -> tuple[float, float]:
        """(start, end) of a transfer of ``seconds`` issued at ``at``; one of no time leaves the link as it was."""
        start = max(self.free, at)
        if seconds <= 0:
            return start, start
        seconds -= min(save, start - self.last, seconds)
        self.free = self.last = start + seconds
        self.wire += seconds
        return start, self.free

    def extend(self, seconds: float) -> float:
        """Hold the transfer that just ended ``seconds`` longer (slowed by traffic the other way); its new end."""
        self.free = self.last = self.free + seconds
        self.wire += seconds
        return self.free
