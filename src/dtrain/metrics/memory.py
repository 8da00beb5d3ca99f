"""Where one rank's memory goes: parameters, gradients, optimizer state, and the peak. Sharded
tensors count their local shard, ZeRO its own partition, and each storage once (DDP's buckets
alias the gradients)."""

from __future__ import annotations

import resource
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class MemoryReport:
    rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    peak_bytes: int | None
    """``torch.cuda.max_memory_allocated`` on a GPU; peak resident set size (RSS) on CPU."""
    peak_kind: str

    @property
    def state_bytes(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state_bytes": self.state_bytes}

    def line(self) -> str:
        peak = "unknown" if self.peak_bytes is None else f"{human_bytes(self.peak_bytes)} ({self.peak_kind})"
        return (f"rank {self.rank}: params {human_bytes(self.params_bytes)}, grads {human_bytes(self.grads_bytes)}, "
                f"optimizer {human_bytes(self.optimizer_bytes)}, total {human_bytes(self.state_bytes)}; peak {peak}")


def human_bytes(n: float, gib_digits: int = 2) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.{gib_digits}f} GiB"


def _local(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``'s bytes on this rank: a DTensor's shard, and the inner
    tensors of a wrapper subclass (torchao's float8 weight under FSDP), whose own storage is empty."""
    t = t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _local(getattr(t, n))]
    return [t]


def _bytes(tensors: Iterable[Any], seen: set[tuple[int, int]]) -> int:
    total = 0
    for t in (x for t in tensors if torch.is_tensor(t) for x in _local(t)):
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def inner_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds the state: through dtrain's forwarding wrappers and ZeRO."""
    while True:
        if hasattr(opt, "optimizer") and isinstance(opt.optimizer, torch.optim.Optimizer):
            opt = opt.optimizer
        elif hasattr(opt, "optim") and isinstance(opt.optim, torch.optim.Optimizer):
            opt = opt.optim  # ZeroRedundancyOptimizer: the local optimizer of this rank's partition
        else:
            return opt


def peak_memory(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "rss"  # KiB on Linux


def memory_report(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer], device: torch.device, rank: int = 0) -> MemoryReport:
    seen: set[tuple[int, int]] = set()
    params = list(model.parameters())
    p_bytes = _bytes(params, seen)
    g_bytes = _bytes((p.grad for p in params if p.grad is not None), seen)
    o_bytes = 0
    for opt in optimizers:
        state = inner_optimizer(opt).state
        o_bytes += _bytes((v for s in state.values() for v in s.values()), seen)
    peak, kind = peak_memory(device)
    return MemoryReport(rank=rank, params_bytes=p_bytes, grads_bytes=g_bytes, optimizer_bytes=o_bytes, peak_bytes=peak, peak_kind=kind)
