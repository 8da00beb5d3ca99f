"""Pipeline model parallelism with ``torch.distributed.pipelining``: an ``nn.Sequential`` cut
into one stage per rank; each batch is split into micro-batches that flow through the stages
(GPipe, Huang et al. 2019; or 1F1B, Narayanan et al., "PipeDream", 2019).

Every rank holds only its stage's layers, their gradients and their optimizer state. There is
no data parallelism: all ranks see the same batch (the first stage reads its inputs, the last
its targets), so ``ctx.setup_dataloader`` does not shard the data under this strategy.

The training step goes through ``ctx.forward_backward(model, inputs, target, loss_fn)``: a
plain ``model(x)`` would run this rank's stage alone. The loss lives on the last stage and is
broadcast, so every rank returns the same value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .._log import note_once
from ..parallel.pipeline import PipelineConfig, build_stage, keep_params
from ..parallel.stages import Pipe, Stages
from ..precision import Precision
from ..world import World
from . import register
from .base import Capabilities, Strategy

if TYPE_CHECKING:
    from ..comm.collectives import Collectives

@register("pipeline")
class PipelineStrategy(Strategy):
    name = "pipeline"
    # Each rank saves its own stage through torch.distributed.checkpoint; the step runs through
    # the stages. ``blocks`` (setup_model): the stages are cut between them when no split points are given.
    capabilities = Capabilities(sharded_state=True, staged_step=True)

    def __init__(self, config: PipelineConfig | None = None, **options: Any) -> None:
        self.config = config or PipelineConfig(**options)
        self._world: World | None = None
        self._stage_module: nn.Module | None = None
        self._pipe: Pipe | None = None

    # -- the strategy protocol ---------------------------------------------------------------
    def setup_model(self, model: nn.Module, world: World, blocks: list[nn.Module] | None = None) -> nn.Module:
        self._world = world
        if not world.distributed:
            note_once("pipeline with one process: one stage, the whole model; no micro-batch schedule.")
        self._stage_module = build_stage(model, world, self.config, blocks)
        self._pipe = Pipe(Stages.of_world(world), self.config, world.device)
        return self._stage_module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        # The optimizer was built on the whole model; keep only this stage's parameters, so the
        # other stages' layers (and their optimizer state) are not held on this rank.
        mine = {id(p) for p in self._stage_module.parameters()} if self._stage_module is not None else set()
        return keep_params(optimizer, mine, "pipeline")

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # no data parallelism: gradients are never all-reduced

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def comm_payload_bytes(self, model: nn.Module) -> None:
        """Activations and their gradients between stages: not counted (unknown)."""
        return None

    def data_parallel(self, world: World) -> tuple[int, int]:
        """(rank, size) for sharding data: one replica, so every rank reads the same batches."""
        return 0, 1

    # -- the step ------------------------------------------------------------------------------
    def forward_backward(self, model: nn.Module, inputs: torch.Tensor, target: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                         accumulation_steps: int, precision: Precision, collectives: Collectives) -> torch.Tensor:
        """Forward and backward of one (micro-)batch through every stage; the mean loss, on every rank.

        Collective: call on every rank with the same batch."""
        return self._pipe.forward_backward(model, inputs, target, loss_fn, accumulation_steps=accumulation_steps,
                                           precision=precision, collectives=collectives)

    def forward_only(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
        """The whole model's output on the last stage (None on the others). Collective: call on
        every rank with the same batch."""
        return self._pipe.forward_only(model, inputs)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over every stage's gradients. Collective: call on every rank."""
        params = [p for p in parameters if p.grad is not None]
        local = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        if self._world is not None and self._world.distributed:
            if norm_type == float("inf"):
                dist.all_reduce(local, op=dist.ReduceOp.MAX)
                total = local
            else:
                powered = local.double() ** norm_type
                dist.all_reduce(powered, op=dist.ReduceOp.SUM)
                total = (powered ** (1.0 / norm_type)).to(local.dtype)
        else:
            total = local
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total


__all__ = ["PipelineConfig", "PipelineStrategy"]
