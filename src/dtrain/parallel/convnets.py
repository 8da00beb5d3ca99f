"""Switches for convolutional nets, applied by ``ctx.setup`` before the strategy wraps the model:
SyncBatchNorm (a module swap keeping the Parameter objects an optimizer holds), then channels-last.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._log import note_once
from ..errors import ConfigError
from ..world import World


def apply_sync_bn(model: nn.Module, world: World, data_parallel_size: int) -> nn.Module:
    """BatchNorm statistics over every rank's batch (on a GPU: torch's SyncBatchNorm needs one)."""
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        note_once("--sync-bn: the model has no BatchNorm layer; nothing to synchronise.")
        return model
    if not world.distributed:
        note_once("--sync-bn has no effect with one process: BatchNorm statistics are this process's batch.")
        return model
    if data_parallel_size < 2:
        raise ConfigError(
            f"--sync-bn shares BatchNorm statistics between data-parallel replicas, but this strategy runs "
            f"{data_parallel_size} replica over {world.size} ranks; use a data-parallel strategy (ddp, zero1, fsdp, hsdp, hvd) or drop --sync-bn."
        )
    if world.device.type != "cuda":
        note_once(
            f"--sync-bn: SyncBatchNorm needs a GPU; on {world.device.type} BatchNorm statistics stay per rank "
            "(each rank normalises with its own batch's mean and variance)."
        )
        return model
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def check_channels_last(strategy: Any) -> None:
    """fully_shard (fsdp, hsdp) shards only contiguous parameters: torch 2.14 raises
    ``NotImplementedError: FSDP does not support non-contiguous parameters`` on an NHWC weight."""
    if strategy.capabilities.sharded_params:  # the fully_shard strategies
        raise ConfigError(
            f"--channels-last does not compose with {strategy.name!r}: fully_shard shards only contiguous "
            "(NCHW) parameters; use ddp, zero1 or hvd for channels-last, or drop --channels-last."
        )


def apply_channels_last(model: nn.Module, strategy: Any) -> nn.Module:
    """Parameters and buffers in channels-last (NHWC) layout; 4-D inputs follow in ``to_channels_last``."""
    check_channels_last(strategy)
    if not any(p.dim() == 4 for p in model.parameters()):
        note_once("--channels-last: the model has no 4-D (convolution) weights; nothing changes (it is for conv nets).")
    return model.to(memory_format=torch.channels_last)


def to_channels_last(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The 4-D tensors among a forward's arguments in channels-last layout (a conv on an NCHW
    input and NHWC weights would otherwise convert on every call)."""
    return tuple(a.contiguous(memory_format=torch.channels_last) if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in args)
