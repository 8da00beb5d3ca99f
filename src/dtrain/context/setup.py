"""What ``ctx.setup`` and ``ctx.setup_dataloader`` do around the strategy's wrap: their argument
checks, the model's preparation before ``parallel.apply.parallelize`` (SyncBatchNorm, channels-last,
the options its blocks allow, every rank's same start under ``debug``), and the loader sharded by
rank (``Context`` keeps the order of the calls; a fault-tolerant job's loader is ``replicas``').
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import _check as check
from ..comm.collectives import Collectives
from ..data.loader import DeviceLoader, reshard
from ..errors import ConfigError
from ..parallel import transforms
from ..parallel.convnets import apply_channels_last, apply_sync_bn
from ..strategies.base import Strategy
from .step import DtrainModule, DtrainOptimizer


def check_model(what: str, model: Any) -> None:
    check.instance(what, model, nn.Module, "give the torch.nn.Module to train (e.g. ctx.setup(model, optimizer))")


def check_optimizer(what: str, optimizer: Any) -> None:
    check.instance(what, optimizer, torch.optim.Optimizer,
                   "give a torch.optim.Optimizer built from the model's parameters (e.g. torch.optim.SGD(model.parameters(), lr=0.1))")
    if isinstance(optimizer, DtrainOptimizer):
        raise ConfigError(f"{what}: this optimizer was already set up; pass the torch optimizer to ctx.setup once.")


def prepare_model(model: nn.Module, *, strategy: Strategy, collectives: Collectives, channels_last: bool, sync_bn: bool,
                  blocks: Sequence[nn.Module] | None, compile: bool, activation_checkpointing: bool
                  ) -> tuple[nn.Module, list[nn.Module]]:
    """The model as ``parallelize`` takes it, and its blocks as a list. Under ``debug``, collective."""
    check_model("ctx.setup_model", model)
    if isinstance(model, DtrainModule):
        raise ConfigError("this model was already set up; call ctx.setup once per model.")
    world = collectives.world
    if sync_bn:
        model = apply_sync_bn(model, world, strategy.data_parallel(world)[1])
    if channels_last:
        model = apply_channels_last(model, strategy)
    blocks = list(blocks) if blocks is not None else []
    transforms.check_options(compile=compile, activation_checkpointing=activation_checkpointing, has_blocks=bool(blocks))
    if collectives.debug and world.distributed:
        with torch.no_grad():
            checksum = float(sum(p.detach().double().sum().item() for p in model.parameters()))
        collectives.check_same("parameter checksum at setup", round(checksum, 6),
                               fix="build the model after dtrain.init(seed=...) so every rank starts alike")
    return model, blocks


def check_loader(loader: Any, shuffle: Any) -> None:
    check.instance("ctx.setup_dataloader", loader, DataLoader,
                   "give a torch.utils.data.DataLoader (e.g. DataLoader(dataset, batch_size=32, shuffle=True))")
    if shuffle is not None:
        check.instance("ctx.setup_dataloader(shuffle=...)", shuffle, bool, "give True, False or None")


def shard_loader(loader: DataLoader, *, strategy: Strategy, collectives: Collectives, seed: int, shuffle: bool | None,
                 device: torch.device, on_last: Callable[[], None]) -> DeviceLoader:
    """``loader`` sharded by the strategy's data-parallel rank (pipeline: one replica over all
    ranks), its batches moved to ``device``. Under ``debug``, collective."""
    world = collectives.world
    if collectives.debug and world.distributed:
        collectives.check_same("dataset length", len(loader.dataset), fix="give every rank the same data set")
    rank, size = strategy.data_parallel(world)
    sharded = reshard(loader, rank=rank, world_size=size, seed=seed, shuffle=shuffle)
    return DeviceLoader(sharded, device, on_last=on_last, world_size=size, on_batch=lambda: collectives.tracker.beat())
