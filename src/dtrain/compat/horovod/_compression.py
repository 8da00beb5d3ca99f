"""Horovod's gradient compressors: objects with ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx) -> tensor``."""

from __future__ import annotations

from typing import Any

import torch

from dtrain import ConfigError


class Compressor:
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


NoneCompressor = Compressor


class _HalfCompressor(Compressor):
    wire: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        # Only floating-point tensors shrink; integers travel unchanged (as in Horovod).
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire:
            return tensor.to(cls.wire), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None else tensor


class FP16Compressor(_HalfCompressor):
    """Floating-point tensors travel as float16."""


class BF16Compressor(_HalfCompressor):
    """Floating-point tensors travel as bfloat16 (dtrain's addition)."""

    wire = torch.bfloat16


class Compression:
    """``hvd.Compression.none`` / ``.fp16`` (and ``.bf16``)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


_BY_NAME = {"none": Compression.none, "fp16": Compression.fp16, "bf16": Compression.bf16}


def check_compressor(compression: Any) -> type[Compressor]:
    """A compressor object, also from its name (``"fp16"``)."""
    if isinstance(compression, str) and compression in _BY_NAME:
        return _BY_NAME[compression]
    if compression is None:
        return Compression.none
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise ConfigError(f"unknown compression {compression!r}; choose hvd.Compression.none or hvd.Compression.fp16.")
    return compression
