"""Sharding with torch's ``fully_shard`` (FSDP2): its options, the wrap policy, ``apply_fully_shard``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._log import note_once
from ..errors import ConfigError

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``FSDPConfig.reduce_dtype``'s names and their dtypes."""


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    wrap: str | None = None
    """Which submodules become their own FSDP unit (all-gathered one at a time):
    None (default) -- the model's blocks when ``ctx.setup`` is given them, else ``size:1000000``;
    ``size:N`` -- every submodule holding at least N parameters not already in a unit;
    ``CLASS[,CLASS...]`` -- every submodule of these class names (e.g. ``Block`` or ``Linear``);
    ``none`` -- only the whole model (one all-gather of everything: the least memory saved)."""
    offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (``CPUOffloadPolicy``);
    the optimizer steps on CPU. Only meaningful on a GPU."""
    reshard_after_forward: bool = True
    """Free all-gathered parameters after forward (gathered again in backward): less memory,
    one more all-gather per unit. False keeps them from forward to backward (ZeRO-2-like)."""
    shard_size: int | None = None
    """hsdp only: ranks a parameter is sharded over (default: the processes of one node)."""
    reduce_dtype: str = "fp32"
    """The dtype gradients are reduced in: ``fp32`` (default, as torchtitan: a sum over many ranks
    keeps its low bits) or ``bf16``/``fp16`` (half the bytes, coarser sums)."""

    def __post_init__(self) -> None:
        if self.wrap is not None:
            parse_wrap(self.wrap)
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ConfigError(f"--fsdp-reduce {self.reduce_dtype!r} is not a reduce dtype; choose one of: {', '.join(REDUCE_DTYPES)}.")
        if self.shard_size is not None and self.shard_size < 1:
            raise ConfigError(f"shard_size must be >= 1, got {self.shard_size}.")


def parse_wrap(text: str) -> int | tuple[str, ...] | None:
    """``size:N`` -> N; ``none`` -> None; ``A,B`` -> class names. ConfigError on anything else."""
    text = text.strip()
    if text == "none":
        return None
    if text.startswith("size:"):
        try:
            n = int(float(text[5:]))
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"--fsdp-wrap {text!r}: size must be a positive parameter count, e.g. size:1000000.")
        return n
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or not all(n.isidentifier() for n in names):
        raise ConfigError(f"--fsdp-wrap {text!r} is not size:N, none, or module class names (e.g. Linear,Block).")
    return names


def units(model: nn.Module, wrap: str) -> list[nn.Module]:
    """The submodules (children before parents) that become FSDP units, the root excluded."""
    policy = parse_wrap(wrap)
    if policy is None:
        return []
    if isinstance(policy, tuple):
        present = {type(m).__name__ for m in model.modules()}
        missing = [n for n in policy if n not in present]
        if missing:
            raise ConfigError(
                f"--fsdp-wrap names {', '.join(missing)}, but the model has no such module; "
                f"its module classes are: {', '.join(sorted(present))}."
            )
        return [m for m in _post_order(model) if m is not model and type(m).__name__ in policy]
    chosen: list[nn.Module] = []
    taken: set[int] = set()
    for m in _post_order(model):  # like FSDP1's size_based_auto_wrap_policy
        if m is model:
            continue
        free = [p for p in m.parameters() if id(p) not in taken]
        if sum(p.numel() for p in free) >= policy:
            chosen.append(m)
            taken.update(id(p) for p in free)
    return chosen


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


DEFAULT_WRAP = "size:1000000"


def mixed_precision(param_dtype: torch.dtype | None, config: FSDPConfig) -> Any:
    """``fully_shard``'s ``MixedPrecisionPolicy``: parameters gathered in ``param_dtype`` (None: as
    they are; the sharded master weights stay fp32), gradients reduced in ``config.reduce_dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reduce = REDUCE_DTYPES[config.reduce_dtype]
    if param_dtype is None and reduce == torch.float32:
        return MixedPrecisionPolicy()  # fp32 throughout: nothing cast
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce)


def fp32_norms(model: nn.Module, mesh: DeviceMesh, config: FSDPConfig, offload: Any) -> list[nn.Module]:
    """Shard each BatchNorm as a unit of its own whose parameters stay fp32 (as FSDP1 did): its
    running statistics are fp32 buffers, which batch_norm refuses beside 16-bit weights. Returns them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m is not model]
    keep = MixedPrecisionPolicy(reduce_dtype=REDUCE_DTYPES[config.reduce_dtype], cast_forward_inputs=False)
    for norm in norms:
        if any(True for _ in norm.parameters()):  # affine=False has nothing to shard
            fully_shard(norm, mesh=mesh, reshard_after_forward=config.reshard_after_forward, offload_policy=offload, mp_policy=keep)
    return norms


def apply_fully_shard(model: nn.Module, mesh: DeviceMesh, config: FSDPConfig, device: torch.device,
                      blocks: list[nn.Module] | None = None, param_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard`` every unit of the wrap policy (no policy: each of ``blocks``), then the root;
    returns the same module."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if config.offload and device.type == "cpu":
        note_once("fsdp: --fsdp-offload on a CPU device: parameters already live in CPU memory; offload ignored.")
    offload = CPUOffloadPolicy(pin_memory=True) if config.offload and device.type != "cpu" else OffloadPolicy()
    # With offload the model stays in host memory: fully_shard moves one unit at a time to the
    # device, so the whole model never has to fit there (_fsdp_init.py, _move_states_to_device).
    if not config.offload or device.type == "cpu":
        model = model.to(device)
    chosen = list(blocks) if config.wrap is None and blocks else units(model, config.wrap or DEFAULT_WRAP)
    policy = mixed_precision(param_dtype, config)
    if param_dtype is not None:
        norms = fp32_norms(model, mesh, config, offload)
        chosen = [m for m in chosen if m not in norms]
    for unit in chosen:
        fully_shard(unit, mesh=mesh, reshard_after_forward=config.reshard_after_forward, offload_policy=offload, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=config.reshard_after_forward, offload_policy=offload, mp_policy=policy)
    return model
