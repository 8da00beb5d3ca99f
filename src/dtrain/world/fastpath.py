"""The fast path on a GPU (docs/performance.md): pure functions of the device and the model, so each
choice is tested on a CPU with a CUDA ``torch.device`` standing in."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FUSED = ("adam", "adamw", "sgd")
"""The optimizers with a fused (single-kernel) CUDA implementation in torch >= 2.4."""


def optimizer_options(name: str, device: torch.device | None) -> dict[str, Any]:
    """Keyword arguments for optimizer ``name`` on ``device``: ``fused=True`` on CUDA."""
    if device is not None and device.type == "cuda" and name in FUSED:
        return {"fused": True}
    return {}


def float8_here(device: torch.device) -> bool:
    """A GPU with float8 kernels here, and torchao installed (``precision.auto_precision`` asks)."""
    import importlib.util

    return float8_capable(device) and importlib.util.find_spec("torchao") is not None


def float8_capable(device: torch.device) -> bool:
    """Whether ``device`` multiplies in float8: a GPU of compute capability >= 8.9 (Ada, Hopper and newer)."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def compile_pays(device: str | None) -> bool:
    """Whether ``--fast`` compiles: on CUDA only (on a CPU compiling takes minutes and does not pay reliably)."""
    if device is not None:
        return str(device).startswith("cuda")
    return torch.cuda.is_available()


def auto_channels_last(model: nn.Module, device: torch.device, strategy: Any) -> bool:
    """Whether the fast path puts ``model`` in channels-last: a conv net (4-D weights) on CUDA,
    under a strategy that keeps whole parameters."""
    if device.type != "cuda" or strategy.capabilities.sharded_params:
        return False
    return any(p.dim() == 4 for p in model.parameters())
