"""Horovod's PyTorch API (``horovod.torch``) on top of torch.distributed and dtrain.

A script written for ``horovodrun -np 2 python train.py`` runs with ``dtrain run -n 2 train.py``
after changing one line::

    import horovod.torch as hvd        ->   import dtrain.compat.horovod as hvd

What is here: ``init``, ``shutdown``, ``is_initialized``, ``rank``, ``local_rank``, ``size``,
``local_size``, ``cross_rank``, ``cross_size``, ``broadcast_parameters``,
``broadcast_optimizer_state``, ``broadcast_object``, ``DistributedOptimizer`` (with
``compression``, ``backward_passes_per_step``, ``op``, ``gradient_predivide_factor``),
``allreduce(_)``, ``allgather``, ``broadcast(_)``, ``join``, ``Compression``, ``Average``, ``Sum``.
What is not (Adasum, process sets, sparse gradients, the timeline) raises an error naming it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dtrain
from dtrain.errors import ConfigError
from dtrain.strategies.hvd import GradientAllReduceOptimizer, HvdConfig

__version__ = "0.28.1+dtrain"  # the Horovod API level this follows

Average = "average"
Sum = "sum"
Adasum = "adasum"


class Compression:
    """Wire formats for ``DistributedOptimizer(compression=...)`` and ``allreduce``."""

    none = "none"
    fp16 = "fp16"
    bf16 = "bf16"


_ctx: dtrain.Context | None = None


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job's process group (rank and size come from ``dtrain run``, torchrun or SLURM)."""
    global _ctx
    if comm is not None or process_sets is not None:
        _unsupported("init(comm=..., process_sets=...)")
    if _ctx is None:
        _ctx = dtrain.init("single")


def shutdown() -> None:
    global _ctx
    if _ctx is not None:
        _ctx.close()
        _ctx = None


def is_initialized() -> bool:
    return _ctx is not None


def _world() -> dtrain.World:
    if _ctx is None:
        raise ConfigError("Horovod has not been initialized; call hvd.init() first.")
    return _ctx.world


def rank() -> int:
    return _world().rank


def local_rank() -> int:
    return _world().local_rank


def size() -> int:
    return _world().size


def local_size() -> int:
    return _world().local_size


def cross_rank() -> int:
    return _world().node_rank


def cross_size() -> int:
    return _world().num_nodes


def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def gloo_enabled() -> bool:
    return dist.is_gloo_available()


def nccl_built() -> bool:
    return dist.is_nccl_available()


def _distributed() -> bool:
    return _world().distributed


# -- the optimizer --------------------------------------------------------------------------
def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, nn.Parameter]] | None = None,
    compression: str = Compression.none,
    backward_passes_per_step: int = 1,
    op: str = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
) -> GradientAllReduceOptimizer:
    """An optimizer that all-reduces each gradient as soon as backward produces it (fused into
    buffers) and waits for them in ``step()``."""
    _world()
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"hvd.DistributedOptimizer got {type(optimizer).__name__} {optimizer!r:.40}; "
                          "give a torch.optim.Optimizer (e.g. torch.optim.SGD(model.parameters(), lr=0.1)).")
    if op == Adasum:
        _unsupported("op=hvd.Adasum")
    if groups is not None or num_groups:
        _unsupported("groups / num_groups (dtrain fuses gradients by size, like DDP buckets)")
    if process_set is not None:
        _unsupported("process_set")
    config = HvdConfig(
        op=op,
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        gradient_predivide_factor=gradient_predivide_factor,
    )
    return GradientAllReduceOptimizer(optimizer, named_parameters, config=config)


# -- broadcasts -----------------------------------------------------------------------------
def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Copy ``root_rank``'s tensors to every rank, in place. ``params`` is a ``state_dict()`` or
    an iterable of ``(name, tensor)`` such as ``model.named_parameters()``.

    Collective: call on every rank."""
    _root(root_rank)
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    if not _distributed():
        return
    with torch.no_grad():
        for _, tensor in items:
            if torch.is_tensor(tensor):
                dist.broadcast(tensor.data if isinstance(tensor, nn.Parameter) else tensor, src=root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every rank ``root_rank``'s optimizer state (hyper-parameters and buffers).

    Collective: call on every rank."""
    _root(root_rank)
    if not _distributed():
        return
    state = broadcast_object(optimizer.state_dict() if rank() == root_rank else None, root_rank)
    if rank() != root_rank:
        optimizer.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Collective: call on every rank. ``root_rank``'s picklable object, on every rank."""
    _root(root_rank)
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=root_rank)
    return box[0]


# -- collectives on tensors -----------------------------------------------------------------
def _reduce_op(average: bool | None, op: str | None) -> str:
    if op is not None and average is not None:
        raise ConfigError("pass either average= or op= to allreduce, not both.")
    if op == Adasum:
        _unsupported("op=hvd.Adasum")
    if op is None:
        return Sum if average is False else Average
    if op not in (Average, Sum):
        raise ConfigError(f"unknown allreduce op {op!r}; choose hvd.Average or hvd.Sum.")
    return op


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """Collective: call on every rank. Reduce ``tensor`` over ranks, in place, and return it."""
    _tensor("hvd.allreduce_", tensor)
    if process_set is not None:
        _unsupported("process_set")
    op = _reduce_op(average, op)
    if prescale_factor != 1.0:
        tensor.mul_(prescale_factor)
    if _distributed():
        dist.all_reduce(tensor)
        if op == Average:
            tensor.div_(size()) if tensor.is_floating_point() else tensor.floor_divide_(size())
    if postscale_factor != 1.0:
        tensor.mul_(postscale_factor)
    return tensor


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: str = Compression.none,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """Collective: call on every rank. A new tensor: ``tensor`` reduced over ranks."""
    _tensor("hvd.allreduce", tensor)
    wire = {Compression.none: None, Compression.fp16: torch.float16, Compression.bf16: torch.bfloat16}.get(compression, "?")
    if wire == "?":
        raise ConfigError(f"unknown compression {compression!r}; choose hvd.Compression.none or hvd.Compression.fp16.")
    out = tensor.detach().clone() if wire is None or not tensor.is_floating_point() else tensor.detach().to(wire)
    allreduce_(out, average=average, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor, process_set=process_set)
    return out.to(tensor.dtype)


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Collective: call on every rank. Every rank's ``tensor`` concatenated along dimension 0
    (the first dimension may differ between ranks; the others must match)."""
    _tensor("hvd.allgather", tensor)
    if process_set is not None:
        _unsupported("process_set")
    if not _distributed():
        return tensor.detach().clone()
    t = tensor.detach().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    rows = torch.tensor([t.shape[0]], device=t.device)
    all_rows = [torch.empty_like(rows) for _ in range(size())]
    dist.all_gather(all_rows, rows)
    counts = [int(r.item()) for r in all_rows]
    padded = torch.zeros((max(counts), *t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(size())]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, counts)])


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Collective: call on every rank. ``root_rank``'s values, written into ``tensor``."""
    _tensor("hvd.broadcast_", tensor)
    _root(root_rank)
    if process_set is not None:
        _unsupported("process_set")
    if _distributed():
        dist.broadcast(tensor, src=root_rank)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Collective: call on every rank. A new tensor with ``root_rank``'s values."""
    _tensor("hvd.broadcast", tensor)
    return broadcast_(tensor.detach().clone(), root_rank, name, process_set)


def join(device: int = -1) -> int:
    """Wait until every rank has called ``join`` and return the rank that arrived last.

    Collective: call on every rank. Unlike Horovod, ranks that joined do not stand in for
    others' all-reduces: every rank must run the same number of optimizer steps before it
    joins (dtrain's samplers give every rank the same number of batches)."""
    if not _distributed():
        return 0
    arrived = torch.tensor([time.time()], dtype=torch.float64)
    times = [torch.empty_like(arrived) for _ in range(size())]
    dist.all_gather(times, arrived)
    return int(torch.stack(times).argmax().item())


def _tensor(what: str, tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"{what} got {type(tensor).__name__} {tensor!r:.40}; give a torch.Tensor (e.g. torch.tensor(value)).")


def _root(root_rank: Any) -> None:
    """``root_rank`` is a rank of this job (checked before any collective, on every rank alike)."""
    n = size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < n:
        raise ConfigError(f"root_rank {root_rank!r} is not a rank of this job (0..{n - 1}); give one of those.")


def _unsupported(what: str) -> None:
    raise ConfigError(f"Horovod feature not supported by dtrain.compat.horovod: {what}.")


__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "Sum", "allgather", "allreduce", "allreduce_",
    "broadcast", "broadcast_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "cross_rank", "cross_size", "init", "is_initialized", "join", "local_rank", "local_size", "rank",
    "shutdown", "size",
]
