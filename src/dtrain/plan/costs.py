"""What one collective costs on a group of ranks: the alpha-beta model (Hockney), ring and tree
algorithms (Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations
in MPICH", 2005), hierarchical across nodes.

Ring all-reduce of B bytes over n ranks: a reduce-scatter then an all-gather, each n-1 steps of
B/n bytes: ``2(n-1) * lat + 2(n-1)/n * B / bw``. A tree (NCCL's double binary tree) needs
~``2 log2(n)`` latencies and ~``2 B / bw``; NCCL picks the cheaper, so the model does too
when the cluster has ``tree``. A group spanning nodes does a reduce-scatter inside each node,
an all-reduce of the shards between nodes (carried by the node's NICs together), and an
all-gather inside each node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cluster import Cluster


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


def ring_allreduce(nbytes: float, n: int, bw: float, lat: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw


def ring_gather(nbytes: float, n: int, bw: float, lat: float) -> float:
    """All-gather (or reduce-scatter) whose full result is ``nbytes``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * lat + (n - 1) / n * nbytes / bw


def tree_allreduce(nbytes: float, n: int, bw: float, lat: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * lat + 2 * nbytes / bw


def _flat_allreduce(nbytes: float, n: int, bw: float, lat: float, tree: bool) -> float:
    ring = ring_allreduce(nbytes, n, bw, lat)
    return min(ring, tree_allreduce(nbytes, n, bw, lat)) if tree else ring


def allreduce(nbytes: float, group: Group, c: Cluster) -> float:
    """Seconds for an all-reduce of ``nbytes`` on ``group``."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if group.nodes == 1:
        return _flat_allreduce(nbytes, group.per_node, c.intra_bw, c.intra_lat, c.tree)
    inter = _flat_allreduce(nbytes, group.nodes, c.inter_bw / group.sharing, c.inter_lat, c.tree)
    if group.per_node == 1:
        return inter
    # Each of the node's members all-reduces 1/per_node of the data between nodes, in parallel,
    # over the node's NICs together: the node still sends ~2(N-1)/N x nbytes.
    intra = 2 * ring_gather(nbytes, group.per_node, c.intra_bw, c.intra_lat)
    return intra + inter


def gather(nbytes: float, group: Group, c: Cluster, *, reduce: bool = False) -> float:
    """Seconds for an all-gather (``reduce``: a reduce-scatter) whose full result is ``nbytes``."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if reduce and c.backend == "gloo":
        # torch's gloo backend reduce-scatters by all-reducing: on the test bed (2 hosts, 20 Mbit/s)
        # a 1 MiB reduce_scatter_tensor took 487-568 ms, its all_reduce 441-449 ms.
        return allreduce(nbytes, group, c)
    if group.nodes == 1:
        return ring_gather(nbytes, group.per_node, c.intra_bw, c.intra_lat)
    inter = ring_gather(nbytes, group.nodes, c.inter_bw / group.sharing, c.inter_lat)
    if group.per_node == 1:
        return inter
    # Between nodes each member moves 1/per_node of the data (the NICs in parallel); then each
    # gathers the rest from its node's members.
    return inter + ring_gather(nbytes, group.per_node, c.intra_bw, c.intra_lat)


def p2p(nbytes: float, group: Group, c: Cluster) -> float:
    """One send from a rank to its neighbour in ``group`` (pipeline stages)."""
    if nbytes <= 0:
        return 0.0
    if group.nodes > 1:
        return c.inter_lat + nbytes * group.sharing / c.inter_bw
    return c.intra_lat + nbytes / c.intra_bw


def fifo(jobs: list[tuple[float, float]]) -> list[float]:
    """End times of transfers (issue time, duration) on one link, served in order."""
    free, ends = 0.0, []
    for issue, duration in jobs:
        free = max(free, issue) + duration
        ends.append(free)
    return ends
