"""apex.parallel on torch: ``DistributedDataParallel`` is torch's DDP, ``convert_syncbn_model``
is ``nn.SyncBatchNorm.convert_sync_batchnorm``. The script initialises the process group
itself, as apex scripts do (``torch.distributed.init_process_group``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain import ConfigError
from dtrain._log import note_once
from dtrain.world import release_at_exit

SyncBatchNorm = nn.SyncBatchNorm


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """apex's DDP signature on torch's DDP. ``message_size`` (elements, apex's bucket size)
    becomes ``bucket_cap_mb``; ``delay_allreduce=True`` becomes one bucket for all gradients."""

    def __init__(
        self,
        module: nn.Module,
        message_size: int = 10_000_000,
        delay_allreduce: bool = False,
        shared_param: Any = None,
        allreduce_trigger_params: Any = None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators: Any = None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: Any = None,
        prof: bool = False,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise ConfigError(f"apex DistributedDataParallel got {type(module).__name__} {module!r:.40}; give the torch.nn.Module to wrap.")
        if not dist.is_initialized():
            raise ConfigError(
                "apex DistributedDataParallel needs a process group; call "
                "torch.distributed.init_process_group(backend=..., init_method='env://') first."
            )
        if not gradient_average or gradient_predivide_factor != 1.0 or allreduce_trigger_params is not None:
            raise ConfigError(
                "apex DDP options gradient_average=False, gradient_predivide_factor and allreduce_trigger_params "
                "are not supported by dtrain.compat.apex."
            )
        param = next(module.parameters(), None)
        on_cuda = param is not None and param.device.type == "cuda"
        bucket_mb = 2**20 if delay_allreduce else max(1.0, message_size * 4 / 2**20)
        super().__init__(
            module,
            device_ids=[param.device.index] if on_cuda else None,
            bucket_cap_mb=bucket_mb,
            gradient_as_bucket_view=True,
        )
        release_at_exit(self)  # the script keeps this model past its destroy_process_group()


def convert_syncbn_model(module: nn.Module, process_group: Any = None, channel_last: bool = False) -> nn.Module:
    """Replace every BatchNorm by SyncBatchNorm (batch statistics over all ranks); on CPU, where
    torch's SyncBatchNorm does not run, they stay per rank and a note says so."""
    if not torch.cuda.is_available():
        note_once("convert_syncbn_model: SyncBatchNorm needs a GPU in torch; on CPU BatchNorm statistics stay per rank.")
        return module
    return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)


__all__ = ["DistributedDataParallel", "SyncBatchNorm", "convert_syncbn_model"]
