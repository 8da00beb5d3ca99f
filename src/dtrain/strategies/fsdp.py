"""Fully sharded data parallel with torch's ``fully_shard`` (FSDP2; ZeRO stage 3): ``fsdp`` shards
over every process, ``hsdp`` over the ranks of a node (or ``shard_size``), replicated across them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from ..parallel.dims import ParallelDims
from ..parallel.fsdp import FSDPConfig
from ..world import World
from . import register
from .layout import SHARDS, LayoutStrategy


def shards(world: World) -> ParallelDims:
    """Every process holds one shard of the whole model."""
    return ParallelDims(dp_shard=world.size)


def hybrid(shard_size: int | None) -> Callable[[World], ParallelDims]:
    """Groups of ``shard_size`` ranks (default: the processes of one node) each hold a sharded
    replica: ``dp_replicate`` = the number of groups, ``dp_shard`` = ``shard_size``."""

    def preset(world: World) -> ParallelDims:
        if not world.distributed:
            return ParallelDims()
        shard = shard_size or world.local_size
        if shard > world.size or world.size % shard:
            raise ConfigError(
                f"hsdp: {world.size} processes cannot be split into groups of {shard} (shard_size); "
                f"use a shard size that divides {world.size}."
            )
        return ParallelDims(dp_replicate=world.size // shard, dp_shard=shard)

    return preset


@register("fsdp", capabilities=SHARDS)
def fsdp(config: FSDPConfig | None = None, **options: Any) -> LayoutStrategy:
    """The layout ``dp_shard=N``, sharded by ``fully_shard``."""
    config = config or FSDPConfig(**options)
    if config.shard_size is not None:
        raise ConfigError("shard_size is an hsdp option; use --strategy hsdp, or drop it for fsdp.")
    return LayoutStrategy("fsdp", shards, capabilities=SHARDS, fsdp=config,
                          alone="fsdp with one process: nothing to shard; running the model as it is.")


@register("hsdp", capabilities=SHARDS)
def hsdp(config: FSDPConfig | None = None, **options: Any) -> LayoutStrategy:
    """The layout ``dp_replicate=R,dp_shard=S`` (S = ``shard_size``), HSDP on its 2-D mesh."""
    config = config or FSDPConfig(**options)
    return LayoutStrategy("hsdp", hybrid(config.shard_size), capabilities=SHARDS, fsdp=config, hybrid=True,
                          alone="hsdp with one process: nothing to shard; running the model as it is.")


__all__ = ["FSDPConfig", "fsdp", "hsdp", "hybrid", "shards"]
