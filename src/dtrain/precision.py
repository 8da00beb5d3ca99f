"""Numeric precision of a run: which dtype autocast uses and whether losses are scaled."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from ._log import note_once
from .errors import ConfigError, first_line

PRESETS = ("fp32", "bf16-mixed", "fp16-mixed")
"""The autocast presets (``float8`` is bf16-mixed with float8 linears: ``Float8Config``)."""
FLOAT8 = "float8"
FLOAT8_RECIPES = ("tensorwise", "rowwise")


@dataclass(frozen=True, kw_only=True)
class Float8Config:
    """float8 training through torchao (``--precision float8``; ``dtrain.parallel.float8``)."""

    recipe: str = "tensorwise"
    """torchao's scaling recipe: ``tensorwise`` (fastest; FSDP all-gathers the weights in float8)
    or ``rowwise`` (more accurate; all-gathered in bf16)."""
    emulate: bool = False
    """torchao's emulation (matmuls in high precision) on a device without float8, for tests; every
    linear whose sides are multiples of 16 is converted, whatever its size."""
    auto: bool = False
    """Chosen by ``--precision auto`` (``--fast``) rather than asked for: a model with no linear
    large enough to gain runs as bf16-mixed."""

    def __post_init__(self) -> None:
        if self.recipe not in FLOAT8_RECIPES:
            raise ConfigError(f"--float8-recipe {self.recipe!r} is not a recipe; choose one of: {', '.join(FLOAT8_RECIPES)}.")


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
    float8: Float8Config | None = None
    """float8 linears inside bf16 autocast (``--precision float8``); None: none."""

    @property
    def effective(self) -> str:
        """The preset actually used (fp16-mixed runs as bf16-mixed on CPU)."""
        if self.float8 is not None:
            return FLOAT8
        if self.autocast_dtype is None:
            return "fp32"
        return "bf16-mixed" if self.autocast_dtype == torch.bfloat16 else "fp16-mixed"

    @classmethod
    def with_float8(cls, recipe: str = "tensorwise", emulate: bool = False) -> Precision:
        """``dtrain.init(precision=Precision.with_float8(recipe="rowwise", emulate=True))``:
        float8 with these settings (``precision="float8"`` is tensorwise on real float8)."""
        return cls(name=FLOAT8, autocast_dtype=torch.bfloat16, float8=Float8Config(recipe=recipe, emulate=emulate))

    @classmethod
    def resolve(cls, name: str | Precision, device: torch.device) -> Precision:
        """Turn a preset name into a Precision for ``device``; raises ConfigError for unknown names
        and for float8 on a device without it (unless emulated)."""
        if isinstance(name, Precision):
            return cls._float8(name.float8, device) if name.float8 is not None else name
        if name == "auto":  # the fast path: float8 or bf16 where the GPU has it, else fp32 (auto_precision)
            name = auto_precision(device)
            if name == FLOAT8:
                return cls._float8(Float8Config(auto=True), device)
        if name == FLOAT8:
            return cls._float8(Float8Config(), device)
        if name not in PRESETS:
            raise ConfigError(f"unknown precision {name!r}; choose one of: {', '.join(PRESETS)}, {FLOAT8}, auto.")
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

    @classmethod
    def _float8(cls, config: Float8Config, device: torch.device) -> Precision:
        if not config.emulate:
            check_float8_device(device)
        check_torchao()
        return cls(name=FLOAT8, autocast_dtype=torch.bfloat16, float8=config, device_type=device.type)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass (a no-op in fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(self.device_type) if self.scale_loss else None


def auto_name(*, gpu: bool, bf16: bool, float8: bool = False) -> str:
    """``--precision auto``, the one rule (training, ``dtrain plan`` and ``--parallel auto`` ask it):
    float8 on a GPU with bf16 and float8 (and torchao), bf16-mixed on a GPU with bf16, fp32 elsewhere
    (a GPU without bf16, e.g. V100; a CPU, which emulates bf16 10x slower for a conv)."""
    if not gpu or not bf16:
        return "fp32"
    return FLOAT8 if float8 else "bf16-mixed"


def auto_precision(device: torch.device, bf16_supported: bool | None = None, float8_supported: bool | None = None) -> str:
    """``auto_name`` asked with ``device``'s facts (``bf16_supported``, ``float8_supported``: default,
    asked of torch)."""
    if device.type != "cuda":
        return auto_name(gpu=False, bf16=False)
    if bf16_supported is None:
        bf16_supported = torch.cuda.is_bf16_supported()
    if float8_supported is None:
        from .world.fastpath import float8_here

        float8_supported = float8_here(device)
    return auto_name(gpu=True, bf16=bf16_supported, float8=float8_supported)


def scaler_skips_itself(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make a GradScaler skip an overflowed step of torch's fused SGD itself; returns ``optimizer``.

    Fused SGD claims to handle overflow in its kernel (``_step_supports_amp_scaling``), but on an
    overflowed step it creates its momentum buffers uninitialised (fp16-mixed then reaches a NaN
    loss); with the flag cleared the scaler skips that step as for any other optimizer."""
    inner = optimizer
    while not isinstance(inner, torch.optim.SGD) and isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    if isinstance(inner, torch.optim.SGD) and inner.defaults.get("fused") and getattr(inner, "_step_supports_amp_scaling", False):
        inner._step_supports_amp_scaling = False
    return optimizer


def check_float8_device(device: torch.device) -> None:
    """ConfigError, one line, where ``device`` has no float8."""
    from .world.fastpath import float8_capable

    if float8_capable(device):
        return
    what = device.type
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        what = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
    raise ConfigError(f"float8 needs a GPU with compute capability >= 8.9 (Hopper/Ada); this is {what}; "
                      "use bf16-mixed, or --float8-emulate for a test.")


def check_torchao() -> None:
    """ConfigError, one line, where torchao's float8 training cannot be imported."""
    quiet = logging.getLogger("torch.utils._pytree")  # torchao 0.18's import warns about an Enum torch now handles
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    except Exception as exc:  # ImportError, or a torchao built for another torch
        raise ConfigError(f"float8 needs torchao's float8 training, which does not import here ({first_line(exc)}); "
                          "install it with: pip install 'dtrain[float8]'.") from None
    finally:
        quiet.setLevel(level)
