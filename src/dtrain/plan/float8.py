"""``--precision float8``: a bf16-mixed plan whose linears that `dtrain train` converts
(``parallel.float8.converts``, tensorwise) run their three matmuls at the data sheet's float8 peak
x the device's achieved fraction (not fitted), their dynamic-scale casts as memory traffic (an
amax read, a cast read and float8 write, a transposed copy), their weights gathered in 1 byte under FSDP.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import ConfigError

FLOAT8_TFLOPS = {"H100 SXM": 1979.0, "H200 SXM": 1979.0}
"""Dense float8 TFLOP/s (NVIDIA's data sheets); compute capability below 8.9 (A100, V100, P100) has none."""
CAST_GRAD_BYTES = 5 + 3
"""Bytes an element of an input or output gradient moves: amax, cast (5), a transposed copy (3)."""
CAST_WEIGHT_BYTES = 2 * 5
"""A weight element: cast in forward and again in backward."""


@dataclass(frozen=True)
class Float8Counts:
    """The converted linears of a model, per sample (``count``) or written as data."""

    fwd_flops: float  # forward matmul FLOPs per sample in the converted linears (backward: twice this)
    fwd_cast_bytes: float  # per sample, the forward's casts; ``bwd_cast_bytes``: the backward's
    bwd_cast_bytes: float
    params: int  # weight elements converted
    block_params: tuple[int, ...] = ()  # of them, in each of the profile's blocks (the rest are in the root unit)
    linears: int = 0


def float8_peak(device: Any) -> float:
    """The device's dense float8 FLOP/s; one ConfigError line where it has none."""
    tflops = FLOAT8_TFLOPS.get(device.name)
    if tflops is None:
        raise ConfigError(f"--precision float8: the plan's device {device.name!r} has no float8 rate (float8 needs compute capability "
                          f">= 8.9; the plan knows {', '.join(FLOAT8_TFLOPS)}: --device h100 or h200); plan --precision bf16-mixed.")
    return tflops * 1e12


def count(task: Any, batch: int, recipe: str = "tensorwise") -> Float8Counts:
    """The linears ``dtrain train --precision float8`` converts in ``task``'s model, counted on meta over one batch."""
    from ..metrics.flops import _to_meta
    from ..parallel.float8 import converts
    from ..precision import Float8Config
    from .machinery import sample_batch

    with torch.device("meta"):
        model = task.build_model()
    blocks = list(task.blocks(model)) if task.blocks else []
    chosen = set(converts(model, Float8Config(recipe=recipe), blocks))
    totals = {"flops": 0.0, "fwd": 0.0, "bwd": 0.0}

    def seen(m: torch.nn.Linear, args: tuple, _out: Any) -> None:
        rows = args[0].numel() // m.in_features
        totals["flops"] += 2.0 * rows * m.in_features * m.out_features
        totals["fwd"] += 5.0 * rows * m.in_features  # amax read, cast read + float8 write
        totals["bwd"] += 3.0 * rows * m.in_features + CAST_GRAD_BYTES * rows * m.out_features  # transposed; the gradient's

    linears = [(name, m) for name, m in model.named_modules() if name in chosen]
    handles = [m.register_forward_hook(seen) for _, m in linears]
    x, _ = sample_batch(task, batch)
    try:
        with torch.no_grad():
            model(_to_meta(x))
    finally:
        for h in handles:
            h.remove()
    per_block = tuple(sum(m.weight.numel() for _, m in linears if any(m is u for u in b.modules())) for b in blocks)
    return Float8Counts(fwd_flops=totals["flops"] / batch, fwd_cast_bytes=totals["fwd"] / batch, bwd_cast_bytes=totals["bwd"] / batch,
                        params=sum(m.weight.numel() for _, m in linears), block_params=per_block, linears=len(linears))


def compute_rates(prof: Any, c: Any, s: Any) -> tuple[float, float]:
    """(forward s, backward s) per sample under float8 on ``c``'s device (the module's docstring)."""
    f8 = prof.float8
    if f8 is None:
        raise ConfigError("--precision float8: the model's float8 linears were not counted (plan.float8.count).")
    dev = c.device
    r16, r8 = dev.flops("bf16-mixed") * dev.achieved, float8_peak(dev) * dev.achieved
    weights = CAST_WEIGHT_BYTES / 2 * f8.params / max(1, s.batch)  # per sample, half in each pass
    fwd = (prof.fwd_flops - f8.fwd_flops) / r16 + f8.fwd_flops / r8 + (f8.fwd_cast_bytes + weights) / dev.mem_bw
    bwd = (prof.fwd_flops * prof.bwd_ratio - 2 * f8.fwd_flops) / r16 + 2 * f8.fwd_flops / r8 + (f8.bwd_cast_bytes + weights) / dev.mem_bw
    return fwd, bwd


def with_float8(plan: Any, task: Any, batch: int) -> Any:
    """``plan`` (made under bf16-mixed) again with the model's float8 linears counted."""
    from . import make_plan

    peak = float8_peak(plan.cluster.device)
    f8 = count(task, batch)
    note = (f"float8 (tensorwise): {f8.linears} linear(s) converted, {f8.fwd_flops / max(1.0, plan.profile.fwd_flops):.0%} of "
            f"the forward FLOPs, their matmuls at the float8 peak ({peak / 1e12:,.0f} TFLOP/s) x the same achieved fraction "
            "as bf16's, their casts at the memory bandwidth, their weights gathered in float8 under fsdp; the rest, and "
            "the activations, as bf16-mixed")
    prof = replace(plan.profile, float8=f8, precision="float8", notes=(*plan.profile.notes, note))
    return make_plan(prof, plan.cluster, replace(plan.settings, precision="float8"),
                     layouts=[p.layout for p in plan.predictions])
