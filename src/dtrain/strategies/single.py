"""One process, no communication: the reference every other strategy is measured against."""

from __future__ import annotations

from torch import nn

from ..world import World
from . import register
from .base import Capabilities, Strategy, move_to_device


@register("single")
class SingleStrategy(Strategy):
    name = "single"
    capabilities = Capabilities()

    def setup_model(self, model: nn.Module, world: World, blocks: list[nn.Module] | None = None) -> nn.Module:
        return move_to_device(model, world)
