"""Pipeline model parallelism with ``torch.distributed.pipelining``: an ``nn.Sequential`` cut
into one stage per rank; each batch is split into micro-batches that flow through the stages
(GPipe, Huang et al. 2019; or 1F1B, Narayanan et al., "PipeDream", 2019).

``pipeline`` is the layout ``pp`` = every process, through the one apply path (its cut is
``dtrain.parallel.apply.apply_pp``). Every rank holds only its stage's layers, their gradients
and their optimizer state. There is no data parallelism: all ranks see the same batch (the first
stage reads its inputs, the last its targets), so ``ctx.setup_dataloader`` does not shard the data
under this strategy.

The training step goes through ``ctx.forward_backward(model, inputs, target, loss_fn)``: a
plain ``model(x)`` would run this rank's stage alone. The loss lives on the last stage and is
broadcast, so every rank returns the same value.
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
