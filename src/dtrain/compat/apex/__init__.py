"""NVIDIA apex's ``amp``, ``parallel``, ``optimizers``, ``fp16_utils`` and ``multi_tensor_apply`` on
torch: an apex script changes ``from apex`` to ``from dtrain.compat.apex`` (docs/compat.md)."""

from . import amp, fp16_utils, multi_tensor_apply, optimizers, parallel

__all__ = ["amp", "fp16_utils", "multi_tensor_apply", "optimizers", "parallel"]
