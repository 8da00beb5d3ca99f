"""Model FLOPs utilisation (PaLM's definition: forward + backward, not recomputation), counted once
on a meta-device copy, against the device's peak from a small table (none on CPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._log import logger

# Dense peak TFLOP/s per GPU from the vendors' data sheets: (16-bit tensor cores, TF32, FP32).
# Matched against torch.cuda.get_device_name(), most specific first.
PEAK_TFLOPS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("H100 PCIe", (756.0, 378.0, 51.0)),
    ("H100 NVL", (835.0, 418.0, 60.0)),
    ("H100", (989.0, 494.0, 67.0)),
    ("H200", (989.0, 494.0, 67.0)),
    ("GH200", (989.0, 494.0, 67.0)),
    ("A100", (312.0, 156.0, 19.5)),
    ("L40S", (362.0, 183.0, 91.6)),
    ("L4", (121.0, 60.0, 30.3)),
    ("V100", (125.0, 15.7, 15.7)),
    ("T4", (65.0, 8.1, 8.1)),
)


def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str | None]:
    """(peak FLOP/s of one device for this precision, its name); (None, None) when unknown (CPU,
    a GPU not in the table)."""
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    for key, (half, tf32, fp32) in PEAK_TFLOPS:
        if key in name:
            if precision.startswith(("bf16", "fp16", "float8")):  # float8: against the bf16 peak, as torchtitan's MFU
                return half * 1e12, f"{name} 16-bit"
            if torch.backends.cuda.matmul.allow_tf32:
                return tf32 * 1e12, f"{name} TF32"
            return fp32 * 1e12, f"{name} FP32"
    return None, None


def count_step_flops(make_model: Callable[[], torch.nn.Module], inputs: Any, target: Any,
                     loss_fn: Callable[[Any, Any], torch.Tensor]) -> int | None:
    """FLOPs of one forward and backward of a fresh model on ``inputs`` (shapes only: all on the
    meta device). None when the model cannot run on meta (the count is then unknown)."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with torch.device("meta"):
            model = make_model()
        meta = _to_meta(inputs), _to_meta(target)
        counter = FlopCounterMode(display=False)
        with counter:
            loss_fn(model(meta[0]), meta[1]).backward()
        return int(counter.get_total_flops())
    except Exception as exc:  # a model that cannot run on meta: MFU is unknown, training goes on
        logger.debug(f"FLOPs not counted: {type(exc).__name__}: {exc}")
        return None


def _to_meta(value: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: torch.empty_like(t, device="meta") if torch.is_tensor(t) else t, value)


def utilisation(flops_per_sample: float | None, samples_per_s: float | None, peak: float | None, devices: int) -> dict[str, Any]:
    """``achieved_tflops`` (all ranks together) and ``mfu`` (a fraction of ``devices`` x peak; None without a peak)."""
    if not flops_per_sample or not samples_per_s:
        return {"achieved_tflops": None, "mfu": None}
    achieved = flops_per_sample * samples_per_s
    return {"achieved_tflops": round(achieved / 1e12, 6), "mfu": round(achieved / (peak * devices), 4) if peak else None}
