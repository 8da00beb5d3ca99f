"""torch's DistributedDataParallel: one process per device, gradients all-reduced in buckets
while the backward pass runs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._log import note_once
from ..errors import ConfigError
from ..world import World
from . import register
from .base import move_to_device, unwrap_module


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    bucket_cap_mb: float = 25.0
    """Gradient bucket size handed to DistributedDataParallel."""
    find_unused_parameters: bool = False
    """Set when some parameters get no gradient in a step (costs a graph traversal per step)."""
    gradient_as_bucket_view: bool = True
    """Gradients alias the all-reduce buckets: one copy less, less memory."""
    broadcast_buffers: bool = True
    """Copy rank 0's buffers (e.g. BatchNorm statistics) to every rank at each forward."""
    static_graph: bool = False

    def __post_init__(self) -> None:
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}.")


@register("ddp")
class DDPStrategy:
    name = "ddp"

    def __init__(self, config: DDPConfig | None = None, **options) -> None:
        self.config = config or DDPConfig(**options)

    def setup_model(self, model: nn.Module, world: World) -> nn.Module:
        model = move_to_device(model, world)
        if not world.distributed:
            note_once("ddp with one process: running without DistributedDataParallel (nothing to synchronise).")
            return model
        if not any(p.requires_grad for p in model.parameters()):
            note_once("ddp: the model has no trainable parameters, so it runs without DistributedDataParallel.")
            return model
        c = self.config
        extra = {} if c.broadcast_buffers else {"broadcast_buffers": False}  # deprecated name in torch>=2.13
        return DistributedDataParallel(
            model,
            device_ids=[world.device.index] if world.device.type == "cuda" else None,
            bucket_cap_mb=c.bucket_cap_mb,
            find_unused_parameters=c.find_unused_parameters,
            gradient_as_bucket_view=c.gradient_as_bucket_view,
            static_graph=c.static_graph,
            **extra,
        )

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return optimizer

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        ddp = _find_ddp(model)
        return ddp.no_sync() if ddp is not None else contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return unwrap_module(model)


def _find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    return model if isinstance(model, DistributedDataParallel) else None
