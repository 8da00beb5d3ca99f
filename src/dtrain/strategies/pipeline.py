"""Pipeline model parallelism with ``torch.distributed.pipelining``: an ``nn.Sequential`` cut into one
stage per rank; the step goes through ``ctx.forward_backward`` (``model(x)`` would run one stage).
"""

from __future__ import annotations

from typing import Any

from ..parallel.dims import ParallelDims
from ..parallel.pipeline import PipelineConfig
from ..world import World
from . import register
from .layout import STAGES, LayoutStrategy


def stages(world: World) -> ParallelDims:
    """One pipeline over every process: a stage each."""
    return ParallelDims(pp=world.size)


@register("pipeline", capabilities=STAGES)
def pipeline(config: PipelineConfig | None = None, **options: Any) -> LayoutStrategy:
    """The layout ``pp=N``, stages driven by a ``1f1b`` or ``gpipe`` schedule. ``blocks``
    (``ctx.setup``): the stages are cut between them when no split points are given."""
    return LayoutStrategy("pipeline", stages, capabilities=STAGES, pipeline=config or PipelineConfig(**options),
                          alone="pipeline with one process: one stage, the whole model; no micro-batch schedule.")


__all__ = ["PipelineConfig", "pipeline", "stages"]
