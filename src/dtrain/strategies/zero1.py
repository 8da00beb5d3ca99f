"""ZeRO stage 1: DDP for gradients; the optimizer rebuilt as torch's ``ZeroRedundancyOptimizer``,
each rank keeping and stepping the state of its share of the parameters. ``prepare_checkpoint``
gathers the whole state on rank 0, so a zero1 checkpoint loads under any strategy and world size.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from ..parallel.placement import Placement
from ..world import World
from . import register
from .base import Capabilities, Strategy
from .ddp import DDPConfig, DDPReplicas
from .layout import no_sync


@dataclass(frozen=True, kw_only=True)
class Zero1Config:
    bucket_cap_mb: float = 25.0
    """Gradient bucket size handed to DistributedDataParallel."""

    def __post_init__(self) -> None:
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}.")


def _zero_class() -> type:
    """torch's ZeroRedundancyOptimizer, imported when first used: ``torch.distributed.optim`` loads
    FSDP and DTensor, a second of every process's start (the launcher's included) on a CPU."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer


def shard_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same optimizer (class, param groups, settings) as a ZeroRedundancyOptimizer."""
    ZeroRedundancyOptimizer = _zero_class()  # noqa: N806 -- torch's class, under its name
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if any(optimizer.state.values()):
        raise ConfigError(
            f"zero1: the {type(optimizer).__name__} already holds state; build the optimizer fresh, "
            "call ctx.setup, then load a checkpoint."
        )
    groups = [dict(g) for g in optimizer.param_groups]
    first = groups[0]
    defaults = {k: v for k, v in optimizer.defaults.items() if k != "params"}
    settings = {k: first.get(k, v) for k, v in defaults.items()}  # not e.g. a scheduler's initial_lr
    # A default the constructor does not take (AdamW's decoupled_weight_decay, fixed by the
    # class itself) would fail the rebuild; keep only what __init__ accepts.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        settings = {k: v for k, v in settings.items() if k in accepted}
    zero = ZeroRedundancyOptimizer(first["params"], optimizer_class=type(optimizer), **settings)
    for group in groups[1:]:
        zero.add_param_group(group)
    return zero


@register("zero1")
class Zero1Strategy(Strategy):
    name = "zero1"
    capabilities = Capabilities()

    def __init__(self, config: Zero1Config | None = None, **options) -> None:
        self.config = config or Zero1Config(**options)
        # The layout is ddp's (every rank a replica, the default), replicated by DDP's piece.
        self._ddp = DDPReplicas(DDPConfig(bucket_cap_mb=self.config.bucket_cap_mb))

    def replicate(self, model: nn.Module, world: World, place: Placement) -> nn.Module:
        self._distributed = world.distributed
        return self._ddp.wrap(model, world, place.group("dp_replicate"))

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        if not getattr(self, "_distributed", True):
            return optimizer  # one process: nothing to shard
        return shard_optimizer(optimizer)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return no_sync(model)

    def comm_payload_bytes(self, model: nn.Module) -> int:
        """Bytes handed to collectives per step: the gradients (all-reduce) and the updated
        parameters (each partition broadcast by its owner)."""
        return 2 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    def prepare_checkpoint(self, objects: dict) -> None:
        """Gather every ZeroRedundancyOptimizer's state on rank 0 (its ``state_dict`` needs it).

        Collective: call on every rank."""
        ZeroRedundancyOptimizer = _zero_class()  # noqa: N806
        for obj in objects.values():
            while isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer):
                obj = obj.optimizer
            if isinstance(obj, ZeroRedundancyOptimizer):
                obj.consolidate_state_dict(to=0)
