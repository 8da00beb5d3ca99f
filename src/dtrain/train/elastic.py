"""Batch semantics when the world size changes (``--elastic-batch``; docs/elastic.md).

``per-process`` (default): every process keeps ``--batch-size``. ``global``: the global batch of
the full job (MAX nodes) is kept; on fewer nodes each process splits its larger share into
micro-batches of at most ``--batch-size`` with gradient accumulation.
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
