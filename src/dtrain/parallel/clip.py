"""Gradient clipping by the global norm over every parallel dimension, in one all-reduce.

``torch.nn.utils.clip_grad_norm_`` refuses a mix of DTensors on several meshes and plain tensors
(a composed model). Here every rank sums |g|^p over its local pieces, each divided by how many
ranks hold that same piece, and one all-reduce adds them up; pipeline stages hold disjoint
parameters, so the same sum covers every stage.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist


def _copies(grad: torch.Tensor, holders: int) -> int:
    """How many of the ``holders`` (the ranks that hold this parameter) hold this same local
    piece of its gradient."""
    spec = getattr(grad, "_spec", None)
    if spec is None:
        return holders  # a plain tensor: whole, and the same, on every holder
    pieces = math.prod(spec.mesh.size(i) for i, p in enumerate(spec.placements) if _splits(p))
    return holders // pieces


def _splits(placement: object) -> bool:
    """Shard, or FSDP-over-TP's ``_StridedShard`` (which, on torch 2.14, is no Shard and says
    ``is_shard() == False``, yet splits the tensor all the same)."""
    return placement.is_shard() or type(placement).__name__ == "_StridedShard"


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's piece (a view: scaling it scales the gradient)."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def settle_grads(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Every gradient laid out as its parameter: under sequence parallelism a LayerNorm's gradient
    is a Partial DTensor (a sum still to take); the norm needs its true value. Collective."""
    grads = []
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        want = getattr(p, "placements", None)
        if want is not None and getattr(g, "placements", want) != want:
            p.grad = g = g.redistribute(g.device_mesh, want)
        grads.append(g)
    return grads


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *,
                    stages: int = 1) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / total)``, ``total`` the norm of all gradients
    across every rank and ``stages`` pipeline stages; returns ``total``. Collective."""
    grads = settle_grads(parameters)
    world = dist.get_world_size() if dist.is_initialized() else 1
    holders = world // stages
    device = _local(grads[0]).device if grads else torch.device("cpu")
    acc = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        local = _local(g).detach().double()
        if math.isinf(norm_type):
            acc = torch.maximum(acc, local.abs().max() if local.numel() else acc)
        else:
            acc += local.abs().pow(norm_type).sum() / _copies(g, holders)
    if world > 1:
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    total = acc if math.isinf(norm_type) else acc.pow(1.0 / norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        _local(g).mul_(coef.to(g.dtype))
    return total.float()


def clip_stages_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *,
                 distributed: bool = True) -> torch.Tensor:
    """Clip by the norm over every stage's gradients where each rank holds one stage's plain
    parameters (a pipeline alone). Collective: call on every rank."""
    params = [p for p in parameters if p.grad is not None]
    local = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    total = local
    if distributed and norm_type == float("inf"):
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
    elif distributed:
        powered = local.double() ** norm_type
        dist.all_reduce(powered, op=dist.ReduceOp.SUM)
        total = (powered ** (1.0 / norm_type)).to(local.dtype)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
