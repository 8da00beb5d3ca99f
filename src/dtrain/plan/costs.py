"""What one collective costs on a group of ranks: the alpha-beta model (Hockney), ring and tree
algorithms (Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations
in MPICH", 2005), hierarchical across nodes.

Ring all-reduce of B bytes over n ranks: ``2(n-1) * lat + 2(n-1)/n * B / bw``. A tree (NCCL's
double binary tree): ~``2 log2(n)`` latencies and ~``2 B / bw``; NCCL picks the cheaper, so the
model does too where the cluster has ``tree``. A group spanning nodes reduce-scatters inside each
node, all-reduces the shards between nodes (over the node's NICs together), and all-gathers inside
each node. Each collective's latency and bandwidth come from ``Cluster.figure`` (measured where
the cluster has a link measurement for it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cluster import Cluster
from .links import shape


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


def _flat(kind: str, nbytes: float, n: int, c: Cluster, crossing: bool, sharing: int = 1) -> float:
    f = c.figure(kind, crossing, sharing)
    t = f.seconds(kind, nbytes, n, c.backend)
    return min(t, tree_allreduce(nbytes, n, f.bw, f.lat)) if kind == "all_reduce" and c.tree else t


def allreduce(nbytes: float, group: Group, c: Cluster) -> float:
    """Seconds for an all-reduce of ``nbytes`` on ``group``."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if group.nodes == 1:
        return _flat("all_reduce", nbytes, group.per_node, c, False)
    inter = _flat("all_reduce", nbytes, group.nodes, c, True, group.sharing)
    if group.per_node == 1:
        return inter
    # each member all-reduces 1/per_node of the data between nodes, in parallel, over the node's NICs
    intra = _flat("reduce_scatter", nbytes, group.per_node, c, False) + _flat("all_gather", nbytes, group.per_node, c, False)
    return intra + inter


def gather(nbytes: float, group: Group, c: Cluster, *, reduce: bool = False) -> float:
    """Seconds for an all-gather (``reduce``: a reduce-scatter) whose full result is ``nbytes``."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if reduce and _reduce_is_allreduce(group, c):
        return allreduce(nbytes, group, c)
    kind = "reduce_scatter" if reduce else "all_gather"
    if group.nodes == 1:
        return _flat(kind, nbytes, group.per_node, c, False)
    inter = _flat(kind, nbytes, group.nodes, c, True, group.sharing)
    # between nodes each member moves 1/per_node of the data; then the rest from its node's members
    return inter if group.per_node == 1 else inter + _flat(kind, nbytes, group.per_node, c, False)


def _reduce_is_allreduce(group: Group, c: Cluster) -> bool:
    """torch's gloo backend has no reduce-scatter of its own: it all-reduces (unless one was measured)."""
    measured = c.links.get("inter" if group.nodes > 1 else "intra")
    return c.backend == "gloo" and (measured is None or "reduce_scatter" not in measured.figures)


def broadcast(nbytes: float, group: Group, c: Cluster, *, messages: int = 1) -> float:
    """Seconds for broadcasts of ``nbytes`` in all to ``group``, one after another, paying the
    link's latency ``messages`` times (queued broadcasts issued before any is waited for: one per
    sending rank)."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    f = c.figure("broadcast", group.nodes > 1, group.sharing)
    steps, _ = shape("broadcast", c.backend)
    return f.seconds("broadcast", nbytes, group.size, c.backend) + (max(1, messages) - 1) * steps(group.size) * f.lat


def p2p(nbytes: float, group: Group, c: Cluster) -> float:
    """One send from a rank to its neighbour in ``group`` (pipeline stages)."""
    if nbytes <= 0:
        return 0.0
    return _flat("send_recv", nbytes, 2, c, group.nodes > 1, group.sharing if group.nodes > 1 else 1)
