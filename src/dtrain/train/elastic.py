"""Batch semantics when the world size changes (``dtrain train --nnodes MIN:MAX --elastic-batch``).

``per-process`` (default): every process keeps ``--batch-size``; the global batch, and with it
the samples per optimizer step, grows and shrinks with the world (the learning rate is not
changed: with fewer processes each step averages fewer samples).

``global``: the global batch stays that of the full job, ``--batch-size`` x processes per node x
MAX nodes; at a smaller world size each process takes a larger share of it and splits it into
micro-batches of at most ``--batch-size`` with gradient accumulation, so the optimizer sees the
same batch, and the same learning rate fits, whatever the number of nodes. The global batch must
divide by every world size the job can have (checked before any worker starts).
"""

from __future__ import annotations

from ..errors import ConfigError


def global_batch(batch: int, nproc: int, min_nodes: int, max_nodes: int) -> int:
    """The fixed global batch of ``--elastic-batch global``; fails unless every world size divides it."""
    total = batch * nproc * max_nodes
    bad = [n * nproc for n in range(min_nodes, max_nodes + 1) if total % (n * nproc)]
    if bad:
        raise ConfigError(f"--elastic-batch global keeps a global batch of {total} (--batch-size {batch} x {nproc} x {max_nodes} "
                          f"nodes), which does not divide by world size {', '.join(map(str, bad))}; choose MIN:MAX so every "
                          "node count divides MAX, or use --elastic-batch per-process.")
    return total


def split(total: int, world_size: int, micro: int) -> tuple[int, int]:
    """This process's batch of a ``total`` global batch, and the micro-batches it is split into."""
    share = total // world_size
    k = -(-share // micro)
    while share % k:
        k += 1
    return share, k
