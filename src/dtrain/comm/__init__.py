"""Communication over slow links: compressed all-reduce, PowerSGD, post-local SGD, and ``auto``;
torch's own methods (DDP comm hooks, PowerSGD, PeriodicModelAverager) attached to a DDP model.
"""

from __future__ import annotations

from torch import nn

from .auto import Auto, LinkMeasurement, choose
from .methods import AllReduce, LocalSGD, PowerSGD, build
from .spec import CHOICES, KINDS, CommSpec

Method = AllReduce | PowerSGD | LocalSGD | Auto


def _hook(method, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP's register_comm_hook checks them against the real classes, and this
    # module's ``from __future__ import annotations`` would turn them into strings.
    return method.communicate(bucket)


def bucket_mb(model: nn.Module, spec: CommSpec, cap_mb: float) -> float:
    """DDP's bucket rule, the one place it is written: ``cap_mb``, or one bucket holding every
    gradient for PowerSGD (and auto, which may pick it; see methods.PowerSGD)."""
    if spec.kind not in ("powersgd", "auto"):
        return cap_mb
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return max(cap_mb, nbytes * 1.05 / 2**20 + 1.0)


def attach(ddp: nn.parallel.DistributedDataParallel, spec: CommSpec) -> Method | None:
    """Register ``spec``'s communication hook on ``ddp``; None for ``none`` (DDP's own all-reduce)."""
    if spec.kind == "none":
        return None
    if spec.kind == "auto":
        method: Method = Auto(spec.warmup, [p.shape for p in ddp.module.parameters() if p.requires_grad])
    else:
        method = build(spec.kind, rank=spec.rank, period=spec.period, warmup=spec.warmup)
    ddp.register_comm_hook(method, _hook)
    return method


__all__ = ["CHOICES", "KINDS", "AllReduce", "Auto", "CommSpec", "LinkMeasurement", "LocalSGD", "Method", "PowerSGD", "attach",
           "bucket_mb", "choose"]
