"""Autocast on the meta device, where ``torch.autocast`` does nothing: the casts a mixed-precision
run makes, and a GPU's fused attention, so that ``plan.profile.count`` sees the saved tensors'
dtypes and sizes a GPU run keeps."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class MetaAutocast(torch.overrides.TorchFunctionMode):
    """Autocast's casts, done on the meta device, where ``torch.autocast`` does nothing (it acts
    on CPU or CUDA tensors only): what the forward saves for backward then has the dtypes a
    mixed-precision run saves. Matrix products and convolutions run in ``dtype`` (their inputs and
    outputs, weights included, as autocast's cached casts are); the ops autocast runs in fp32
    (normalisations, softmax, losses) get fp32 inputs; the rest run in their inputs' dtype. With
    ``fused_attention`` (a GPU), ``scaled_dot_product_attention`` without a mask is the fused
    kernel the GPU runs (flash in 16 bits, else memory-efficient: they save q, k, v, the output and
    a log-sum-exp, not the attention matrix that the meta device's reference version keeps)."""

    F = torch.nn.functional
    LOW = (F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
           torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.addbmm, torch.Tensor.matmul,
           torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.bmm, torch.einsum, F.scaled_dot_product_attention)
    FP32 = (F.layer_norm, F.group_norm, F.rms_norm, F.softmax, F.log_softmax, F.cross_entropy, F.nll_loss, F.mse_loss,
            F.l1_loss, F.smooth_l1_loss, F.binary_cross_entropy_with_logits, F.kl_div, F.softplus, F.normalize,
            torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax, torch.logsumexp)

    def __init__(self, dtype: torch.dtype, *, fused_attention: bool, weights: Any = None) -> None:
        super().__init__()
        self.dtype, self.fused_attention, self.weights = dtype, fused_attention, weights

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.LOW:
            args, kwargs = self._cast((args, kwargs), self.dtype)
            if func is self.F.scaled_dot_product_attention and self.fused_attention:
                return _fused_attention(*args, **kwargs)
        elif func in self.FP32:
            args, kwargs = self._cast((args, kwargs), torch.float32)
        return func(*args, **kwargs)

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        """Floating tensors in ``value`` (nested tuples, lists, dicts) as ``dtype``. A parameter's
        cast copy is the weights', not an activation (it does not grow with the batch): ``weights``
        (the saved-tensor counter, ``profile._Saved``) is told to leave it out."""
        if torch.is_tensor(value):
            if not value.is_floating_point() or value.dtype == dtype:
                return value
            out = value.to(dtype)
            if isinstance(value, nn.Parameter) and self.weights is not None:
                self.weights.exclude(out)
            return out
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast(v, dtype) for v in value)
        if isinstance(value, dict):
            return {k: self._cast(v, dtype) for k, v in value.items()}
        return value


def _fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The GPU's fused attention on meta tensors (torch's own kernels' meta functions and autograd
    formulas: their saved tensors and FLOPs), the reference version where they do not apply."""
    if attn_mask is not None or enable_gqa or q.shape[1] != k.shape[1]:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if q.dtype in (torch.float16, torch.bfloat16):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal, scale=scale)[0]
