"""torch's ``nn.DataParallel``: one process drives every visible GPU from threads (one GIL, the
model copied every step), for comparison; ddp is preferred. Without two GPUs, a single process.
"""

from __future__ import annotations

import torch
from torch import nn

from .._log import note_once
from ..errors import ConfigError
from ..parallel.dims import ParallelDims
from ..parallel.placement import Placement
from ..world import World
from . import register
from .base import Capabilities, Strategy


@register("dp")
class DataParallelStrategy(Strategy):
    name = "dp"
    capabilities = Capabilities()  # gradients land on the first device: nothing to hold back in no_sync

    def layout(self, world: World) -> ParallelDims:
        """One process (DataParallel replicates over the GPUs inside it)."""
        if world.distributed:
            raise ConfigError(
                f"strategy 'dp' runs in one process, but this job has {world.size}; "
                "start it with -n 1, or use --strategy ddp for several processes."
            )
        return ParallelDims()

    def replicate(self, model: nn.Module, world: World, place: Placement) -> nn.Module:
        """``nn.DataParallel`` over every visible GPU (the model on the device without two)."""
        model = model.to(world.device)
        n_gpus = torch.cuda.device_count() if world.device.type == "cuda" else 0
        if n_gpus < 2:
            what = "no GPU" if n_gpus == 0 else "one GPU"
            note_once(f"dp: {what} visible, so DataParallel has nothing to split; running as a single process.")
            return model
        return nn.DataParallel(model, device_ids=list(range(n_gpus)), output_device=world.device.index)
