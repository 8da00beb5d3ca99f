"""A layout as given (``--parallel dp_shard=2,tp=2``), each dimension run its usual way, so a layout
of one way is the named strategy itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from torch import nn

from ..comm import CommSpec
from ..errors import ConfigError
from ..parallel.dims import ParallelDims, resolve
from ..parallel.fsdp import FSDPConfig
from ..parallel.pipeline import PipelineConfig
from ..world import World
from . import register
from .ddp import DDPConfig, DDPReplicas
from .layout import REPLICAS, SHARDS, SPLITS, STAGES, LayoutStrategy, combined

_DDP_OPTIONS = tuple(f.name for f in fields(DDPConfig) if f.name != "comm")
_FSDP_OPTIONS = ("wrap", "offload", "reshard_after_forward", "reduce_dtype")  # the layout sets the shard size
_PIPELINE_OPTIONS = tuple(f.name for f in fields(PipelineConfig))


def label(dims: ParallelDims) -> str:
    """The name a layout goes by in records: that of its one way (ddp, fsdp, hsdp, pipeline),
    single without any, composed for a mix."""
    if dims.tp == 1 and dims.pp == 1:
        if dims.dp_shard > 1:
            return "hsdp" if dims.dp_replicate > 1 else "fsdp"
        return "ddp" if dims.dp_replicate > 1 else "single"
    return "pipeline" if dims.tp == 1 and dims.dp == 1 else "composed"


def by_ddp(dims: ParallelDims) -> bool:
    """Replicas alone (plain parameters, no stages): torch's DDP, with ``--comm``."""
    return dims.dp_replicate > 1 and dims.dp_shard == dims.tp == dims.pp == 1


@register("composed", capabilities=SPLITS)
def composed(parallel: str | dict | ParallelDims | None = None, *, tp_plan: Callable[[nn.Module, int], dict] | None = None,
             comm: str | CommSpec | None = None, comm_warmup: int | None = None, fsdp: FSDPConfig | None = None,
             pipeline: PipelineConfig | None = None, **options: Any) -> LayoutStrategy:
    """The layout ``parallel`` with each dimension's way and the options those ways take
    (without a layout: one replica, declared as a composed layout)."""
    if tp_plan is not None and not callable(tp_plan):
        raise ConfigError(f"tp_plan is a {type(tp_plan).__name__}; give a function (model, tp) -> {{name: ParallelStyle}}.")
    dims = resolve(parallel) if parallel is not None else ParallelDims()
    ddp = by_ddp(dims)
    taken = _check_options(dims, ddp, options)
    replicas = DDPReplicas(DDPConfig(comm=CommSpec.parse(comm, warmup=comm_warmup), **taken["ddp"])) if ddp else None
    if dims.dp_shard > 1:
        fsdp = fsdp or FSDPConfig(**taken["fsdp"])
    if dims.pp > 1:
        pipeline = pipeline or PipelineConfig(**taken["pipeline"])
    fsdp2_replicate = dims.dp_replicate > 1 and dims.dp_shard == 1 and not ddp
    declared = [c for c, used in ((REPLICAS, ddp), (SHARDS, dims.dp_shard > 1), (STAGES, dims.pp > 1),
                                  (SPLITS, dims.tp > 1 or fsdp2_replicate)) if used]
    return LayoutStrategy(label(dims) if parallel is not None else "composed", _given(dims),
                          capabilities=combined(*declared) if parallel is not None else SPLITS,
                          ddp=replicas, fsdp=fsdp if dims.dp_shard > 1 else None,
                          pipeline=pipeline if dims.pp > 1 else None, tp_plan=tp_plan)


def _given(dims: ParallelDims) -> Callable[[World], ParallelDims]:
    def preset(world: World) -> ParallelDims:
        dims.check_world(world.size)
        return dims

    return preset


def _check_options(dims: ParallelDims, ddp: bool, options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The options, by the way that takes them: DDP's (replicas alone), fsdp's (``dp_shard``),
    the pipeline's (``pp``); one line for any other."""
    ways = {"ddp": _DDP_OPTIONS if ddp else (), "fsdp": _FSDP_OPTIONS if dims.dp_shard > 1 else (),
            "pipeline": _PIPELINE_OPTIONS if dims.pp > 1 else ()}
    taken = {way: {k: v for k, v in options.items() if k in names} for way, names in ways.items()}
    unknown = sorted(set(options) - {k for names in ways.values() for k in names})
    if unknown:
        what = [f"{way}'s ({', '.join(names)})" for way, names in ways.items() if names]
        raise ConfigError(f"parallel={dims} takes {', '.join([*what, 'tp_plan'])}; drop {', '.join(unknown)}.")
    return taken


__all__ = ["by_ddp", "composed", "label"]
