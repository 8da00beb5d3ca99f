"""Numeric precision of a run: which dtype autocast uses and whether losses are scaled."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ._log import note_once
from .errors import ConfigError

PRESETS = ("fp32", "bf16-mixed", "fp16-mixed")


@dataclass(frozen=True, kw_only=True)
class Precision:
    """A precision preset resolved for one device type."""

    name: str
    """The preset as the user asked for it: one of ``PRESETS``."""
    autocast_dtype: torch.dtype | None = None
    """dtype of matmuls/convolutions under autocast; None means plain fp32."""
    scale_loss: bool = False
    """Use a GradScaler (fp16 on CUDA, whose narrow exponent underflows small gradients)."""
    device_type: str = "cpu"

    @property
    def effective(self) -> str:
        """The preset actually used (fp16-mixed runs as bf16-mixed on CPU)."""
        if self.autocast_dtype is None:
            return "fp32"
        return "bf16-mixed" if self.autocast_dtype == torch.bfloat16 else "fp16-mixed"

    @classmethod
    def resolve(cls, name: str | Precision, device: torch.device) -> Precision:
        """Turn a preset name into a Precision for ``device``; raises ConfigError for unknown names."""
        if isinstance(name, Precision):
            return name
        if name == "auto":  # the fast path: bf16 where the GPU has it, else fp32 (dtrain.world.fastpath)
            from .world.fastpath import auto_precision

            name = auto_precision(device)
        if name not in PRESETS:
            raise ConfigError(f"unknown precision {name!r}; choose one of: {', '.join(PRESETS)}, auto.")
        dtype = device.type
        if name == "fp32":
            return cls(name=name, device_type=dtype)
        if name == "bf16-mixed":
            return cls(name=name, autocast_dtype=torch.bfloat16, device_type=dtype)
        if dtype == "cpu":
            note_once(
                "fp16-mixed on CPU: CPU autocast has poor float16 kernels, so dtrain uses bfloat16 "
                "(bf16-mixed) instead."
            )
            return cls(name=name, autocast_dtype=torch.bfloat16, device_type=dtype)
        return cls(name=name, autocast_dtype=torch.float16, scale_loss=True, device_type=dtype)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass (a no-op in fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(self.device_type) if self.scale_loss else None


def scaler_skips_itself(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make a GradScaler skip an overflowed step of torch's fused SGD itself.

    A fused optimizer tells the scaler it handles overflow in its kernel
    (``_step_supports_amp_scaling``), so the scaler hands it the inf flag instead of skipping the
    step. Fused SGD's kernel then leaves the weights alone but creates its momentum buffers
    uninitialised (seen with torch 2.11 on an H200 and 2.14 on CPU: fp16-mixed trained the
    synthetic task to a NaN loss by step 10, the first steps' routine overflows). With the flag
    cleared, the scaler unscales, skips an overflowed step and calls the fused kernel only on finite
    gradients, as for any other optimizer. Fused Adam, AdamW and Adagrad honour the flag and keep it.
    Follows wrappers' ``.optimizer`` to the torch optimizer; returns ``optimizer``."""
    inner = optimizer
    while not isinstance(inner, torch.optim.SGD) and isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    if isinstance(inner, torch.optim.SGD) and inner.defaults.get("fused") and getattr(inner, "_step_supports_amp_scaling", False):
        inner._step_supports_amp_scaling = False
    return optimizer

