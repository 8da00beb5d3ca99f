"""NVIDIA apex's ``amp`` and ``parallel`` on torch.autocast, GradScaler, DDP and SyncBatchNorm.

Change one line of an apex script::

    from apex import amp                 ->   from dtrain.compat.apex import amp
    from apex.parallel import DistributedDataParallel as DDP
                                          ->   from dtrain.compat.apex.parallel import DistributedDataParallel as DDP

    from apex.optimizers import FusedAdam  ->   from dtrain.compat.apex.optimizers import FusedAdam
    from apex.fp16_utils import to_python_float, FP16_Optimizer
                                          ->   from dtrain.compat.apex.fp16_utils import ...
    from apex.multi_tensor_apply import multi_tensor_applier (+ ``amp_C`` from the same module)
"""

from . import amp, fp16_utils, multi_tensor_apply, optimizers, parallel

__all__ = ["amp", "fp16_utils", "multi_tensor_apply", "optimizers", "parallel"]
