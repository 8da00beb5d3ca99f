"""NVIDIA apex's ``amp`` and ``parallel`` on torch.autocast, GradScaler, DDP and SyncBatchNorm.

Change one line of an apex script::

    from apex import amp                 ->   from dtrain.compat.apex import amp
    from apex.parallel import DistributedDataParallel as DDP
                                          ->   from dtrain.compat.apex.parallel import DistributedDataParallel as DDP
"""

from . import amp, parallel

__all__ = ["amp", "parallel"]
