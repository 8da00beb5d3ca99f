"""The device a process trains on and the backend that goes with it: the user's choice, checked
against what this machine has, or the GPU of its local rank when there is one, else the CPU."""

from __future__ import annotations

import torch

from ..errors import ConfigError


def pick_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    """``device`` if given (checked), else ``cuda:<local rank>`` when CUDA is there, else the CPU."""
    if device is not None:
        return check_device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def usable_devices() -> list[str]:
    """The device types this torch build can train on here."""
    found = ["cpu"]
    for kind in ("cuda", "xpu", "mps"):
        module = getattr(torch, kind, None) if kind != "mps" else getattr(torch.backends, "mps", None)
        try:
            if module is not None and module.is_available():
                found.append(kind)
        except Exception:  # a broken driver counts as absent; World.detect reports what is there
            pass
    return found


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device, if this machine has it; else one ConfigError line."""
    usable = usable_devices()
    if not isinstance(device, (str, torch.device)) or isinstance(device, bool):
        raise ConfigError(f"device {device!r} is of type {type(device).__name__}; give a string such as {' or '.join(usable)}.")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"device {str(device)!r} is not a device type torch knows; use one of: {', '.join(usable)}.") from None
    if dev.type not in usable:
        why = "CUDA is not available" if dev.type == "cuda" else f"this machine has no {dev.type} device dtrain can use"
        raise ConfigError(f"device {str(dev)!r} requested but {why}; use one of: {', '.join(usable)}.")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device {str(dev)!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                          f"numbered 0..{torch.cuda.device_count() - 1}; pick one of those.")
    if dev.type == "cpu" and dev.index not in (None, 0):
        raise ConfigError(f"device {str(dev)!r}: the CPU has no index; use cpu.")
    return dev
