"""``apex.multi_tensor_apply.multi_tensor_applier`` and the ``amp_C`` kernels scripts call
through it (``multi_tensor_scale``, ``multi_tensor_l2norm``, ``multi_tensor_axpby``), on torch's
``_foreach`` ops. ``noop_flag`` (a one-element int tensor) is set to 1 on a non-finite value,
as apex's kernels do."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch


def _flag(noop_flag: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    if tensors and not all(bool(torch.isfinite(t).all()) for t in tensors):
        noop_flag.fill_(1)


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], scale: float) -> None:
    """out[i] = in[i] * scale."""
    src, dst = tensor_lists
    _flag(noop_flag, src)
    torch._foreach_copy_(dst, torch._foreach_mul([s.to(d.dtype) for s, d in zip(src, dst)], scale))


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                        per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(the L2 norm of all tensors together, each tensor's norm when ``per_tensor``)."""
    (tensors,) = tensor_lists
    _flag(noop_flag, tensors)
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors)]) if tensors else torch.zeros(0)
    total = torch.linalg.vector_norm(norms).reshape(1)
    return total, norms if per_tensor else torch.zeros(0)


def multi_tensor_axpby(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                       a: float, b: float, arg_to_check: int = -1) -> None:
    """out[i] = a * x[i] + b * y[i]."""
    xs, ys, outs = tensor_lists
    _flag(noop_flag, xs + ys if arg_to_check == -1 else (xs if arg_to_check == 0 else ys))
    torch._foreach_copy_(outs, torch._foreach_add(torch._foreach_mul(xs, a), torch._foreach_mul(ys, b)))


amp_C = SimpleNamespace(multi_tensor_scale=multi_tensor_scale, multi_tensor_l2norm=multi_tensor_l2norm,
                        multi_tensor_axpby=multi_tensor_axpby)


class MultiTensorApply:
    """``multi_tensor_applier(op, noop_flag, tensor_lists, *args)`` calls ``op`` on the lists."""

    available = True

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        return None

    def __call__(self, op: Callable[..., Any], noop_flag_buffer: torch.Tensor, tensor_lists: list, *args: Any) -> Any:
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)

__all__ = ["MultiTensorApply", "amp_C", "multi_tensor_applier"]
