"""One process, no communication: the reference every other strategy is measured against."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..world import World
from . import register
from .base import move_to_device, unwrap_module


@register("single")
class SingleStrategy:
    name = "single"

    def setup_model(self, model: nn.Module, world: World) -> nn.Module:
        return move_to_device(model, world)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return optimizer

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return unwrap_module(model)
