"""Horovod's tensor collectives: blocking, in-place, ``*_async`` with handles, grouped, and
differentiable (the blocking out-of-place forms carry gradients, as in Horovod)."""

from __future__ import annotations

import pickle
from typing import Any

import torch

from dtrain import ConfigError

from . import _basics
from . import _collectives as C
from ._basics import ProcessSet
from ._compression import Compression, check_compressor
from ._engine import Handle, HorovodInternalError

Average, Sum, Adasum, Min, Max, Product = C.Average, C.Sum, C.Adasum, C.Min, C.Max, C.Product


def _tensor(what: str, tensor: Any) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"{what} got {type(tensor).__name__} {tensor!r:.40}; give a torch.Tensor (e.g. torch.tensor(value)).")
    return tensor


def _op(average: bool | None, op: Any) -> int:
    if op is not None and average is not None:
        raise ValueError("pass either average= or op= to an allreduce, not both.")
    if op is None:
        return Sum if average is False else Average
    if op not in C.OP_NAMES:
        raise ConfigError(f"unknown reduce op {op!r}; choose one of hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product.")
    return int(op)


def _root(root_rank: Any, ps: ProcessSet) -> int:
    n = _basics.size()
    members = ps.ranks if ps.ranks is not None else range(n)
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in members:
        raise ConfigError(f"root_rank {root_rank!r} is not a rank of this process set ({list(members)}); give one of those.")
    return root_rank


def _submit(fn, name: str | None) -> Handle:
    return _basics.engine().submit(fn, name)


def _into(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` written into ``t`` (an in-place operation's result), outside autograd."""
    with torch.no_grad():
        return t.copy_(value)


def poll(handle: Handle) -> bool:
    """True once the operation behind ``handle`` has finished (never blocks)."""
    return handle.done.is_set()


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``'s operation and return its result (raises its error, if any)."""
    return handle.wait()


# -- allreduce ------------------------------------------------------------------------------
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=None) -> Handle:
    """Collective: call on every rank of the set. A handle to a new tensor: ``tensor`` reduced."""
    t, o, ps = _tensor("hvd.allreduce_async", tensor), _op(average, op), _basics.resolve(process_set)
    return _submit(lambda: C.allreduce_body(t, o, prescale_factor, postscale_factor, ps), name)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None) -> Handle:
    """Collective: call on every rank of the set. Reduce ``tensor`` in place; the handle gives it back."""
    t, o, ps = _tensor("hvd.allreduce_async_", tensor), _op(average, op), _basics.resolve(process_set)

    def body() -> torch.Tensor:
        with torch.no_grad():
            if C.allreduce_in_place(t, o, prescale_factor, postscale_factor, ps):
                return t
        return _into(t, C.allreduce_body(t, o, prescale_factor, postscale_factor, ps))

    return _submit(body, name)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """Collective: call on every rank of the set. Reduce ``tensor`` in place and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, pre, post, ps, name):
        ctx.args = (op, pre, post, ps)
        return synchronize(_submit(lambda: C.allreduce_body(tensor, op, pre, post, ps), name))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, ps = ctx.args
        return synchronize(_submit(lambda: C.allreduce_body(grad, op, pre, post, ps), None)), None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """Collective: call on every rank of the set. A new tensor: ``tensor`` reduced over the set
    (differentiable: the gradient is reduced the same way)."""
    t, o, ps = _tensor("hvd.allreduce", tensor), _op(average, op), _basics.resolve(process_set)
    compression = check_compressor(compression)
    wire, cctx = compression.compress(t)
    out = _AllreduceFn.apply(wire, o, prescale_factor, postscale_factor, ps, name)
    return compression.decompress(out, cctx)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None) -> list[torch.Tensor]:
    """Collective: call on every rank of the set. ``allreduce`` of each tensor."""
    return [allreduce(t, average, None, compression, op, prescale_factor, postscale_factor, process_set) for t in tensors]


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=None) -> Handle:
    ts, o, ps = [_tensor("hvd.grouped_allreduce", t) for t in tensors], _op(average, op), _basics.resolve(process_set)
    return _submit(lambda: [C.allreduce_body(t, o, prescale_factor, postscale_factor, ps) for t in ts], name)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=None) -> Handle:
    ts, o, ps = [_tensor("hvd.grouped_allreduce_", t) for t in tensors], _op(average, op), _basics.resolve(process_set)
    return _submit(lambda: [_into(t, C.allreduce_body(t, o, prescale_factor, postscale_factor, ps)) for t in ts], name)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=None) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set))


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=None):
    """Collective: call on every rank of the set. A callable that returns the reduced sparse tensor
    (reduced as a dense tensor: same result as Horovod's allgather of indices and values)."""
    handle = allreduce_async(_tensor("hvd.sparse_allreduce_async", tensor).to_dense(), name=name, op=op,
                             process_set=process_set)
    return lambda: synchronize(handle).to_sparse()


# -- allgather ------------------------------------------------------------------------------
class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, ps, name):
        out, dims0 = synchronize(_submit(lambda: C.allgather_body(tensor, ps), name))
        ctx.args = (ps, dims0, ps.rank())
        return out

    @staticmethod
    def backward(ctx, grad):
        ps, dims0, me = ctx.args
        summed = synchronize(_submit(lambda: C.allreduce_body(grad, Average, 1.0, 1.0, ps), None))
        start = sum(dims0[:me])
        return summed[start: start + dims0[me]], None, None


def allgather(tensor, name=None, process_set=None) -> torch.Tensor:
    """Collective: call on every rank of the set. Every member's ``tensor`` concatenated along
    dimension 0 (which may differ between ranks; the others must match). Differentiable."""
    return _AllgatherFn.apply(_tensor("hvd.allgather", tensor), _basics.resolve(process_set), name)


def allgather_async(tensor, name=None, process_set=None) -> Handle:
    t, ps = _tensor("hvd.allgather_async", tensor), _basics.resolve(process_set)
    return _submit(lambda: C.allgather_body(t, ps)[0], name)


def grouped_allgather(tensors, name=None, process_set=None) -> list[torch.Tensor]:
    return [allgather(t, None, process_set) for t in tensors]


def grouped_allgather_async(tensors, name=None, process_set=None) -> Handle:
    ts, ps = [_tensor("hvd.grouped_allgather", t) for t in tensors], _basics.resolve(process_set)
    return _submit(lambda: [C.allgather_body(t, ps)[0] for t in ts], name)


def allgather_object(obj: Any, name: str | None = None, process_set=None) -> list[Any]:
    """Collective: call on every rank of the set. Every member's picklable ``obj``, in rank order."""
    ps = _basics.resolve(process_set)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)

    def body() -> list[Any]:
        sizes, _ = C.allgather_body(torch.tensor([data.numel()]), ps)
        blob, _ = C.allgather_body(data, ps)
        out, at = [], 0
        for n in sizes.tolist():
            out.append(pickle.loads(blob[at: at + n].numpy().tobytes()))
            at += n
        return out

    return synchronize(_submit(body, name))


# -- broadcast ------------------------------------------------------------------------------
class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root, ps, name):
        ctx.args = (root, ps)
        return synchronize(_submit(lambda: C.broadcast_body(tensor, root, ps), name))

    @staticmethod
    def backward(ctx, grad):
        root, ps = ctx.args
        summed = synchronize(_submit(lambda: C.allreduce_body(grad, Average, 1.0, 1.0, ps), None))
        return (summed if _basics.rank() == root else torch.zeros_like(summed)), None, None, None


def broadcast(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    """Collective: call on every rank of the set. A new tensor with ``root_rank``'s values."""
    ps = _basics.resolve(process_set)
    return _BroadcastFn.apply(_tensor("hvd.broadcast", tensor), _root(root_rank, ps), ps, name)


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> Handle:
    t, ps = _tensor("hvd.broadcast_async", tensor), _basics.resolve(process_set)
    root = _root(root_rank, ps)
    return _submit(lambda: C.broadcast_body(t, root, ps), name)


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> Handle:
    t, ps = _tensor("hvd.broadcast_async_", tensor), _basics.resolve(process_set)
    root = _root(root_rank, ps)
    return _submit(lambda: _into(t, C.broadcast_body(t, root, ps)), name)


def broadcast_(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    """Collective: call on every rank of the set. ``root_rank``'s values, written into ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set=None) -> Any:
    """Collective: call on every rank of the set. ``root_rank``'s picklable object, on every rank."""
    ps = _basics.resolve(process_set)
    root = _root(root_rank, ps)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if _basics.rank() == root else None

    def body() -> Any:
        size = C.broadcast_body(torch.tensor([data.numel() if data is not None else 0]), root, ps)
        blob = C.broadcast_body(data if data is not None else torch.empty(int(size), dtype=torch.uint8), root, ps)
        return pickle.loads(blob.numpy().tobytes())

    return synchronize(_submit(body, name))


# -- alltoall and reducescatter -------------------------------------------------------------
def _splits(tensor: torch.Tensor, splits: Any, n: int) -> torch.Tensor:
    rows = tensor.shape[0] if tensor.dim() else 1
    if splits is None:
        if rows % n:
            raise ValueError(f"hvd.alltoall without splits needs a first dimension divisible by {n} ranks, got {rows}; "
                             "pass splits=.")
        return torch.full((n,), rows // n, dtype=torch.int32)
    splits = torch.as_tensor(splits)
    if splits.dtype != torch.int32 or splits.numel() != n:
        raise ValueError(f"hvd.alltoall splits must be {n} int32 values (one per rank), got {splits.dtype} {list(splits.shape)}.")
    if int(splits.sum()) != rows or bool((splits < 0).any()):
        raise ValueError(f"hvd.alltoall splits {splits.tolist()} must be >= 0 and add up to the first dimension {rows}.")
    return splits


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, ps, name):
        out, received = synchronize(_submit(lambda: C.alltoall_body(tensor, splits, ps), name))
        ctx.args = (ps, received)
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        ps, received = ctx.args
        back, _ = synchronize(_submit(lambda: C.alltoall_body(grad.contiguous(), received, ps), None))
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Collective: call on every rank of the set. Send ``splits[i]`` rows to member i (equal parts
    when ``splits`` is None); returns the received rows, and the received splits when given splits."""
    ps = _basics.resolve(process_set)
    t = _tensor("hvd.alltoall", tensor)
    out, received = _AlltoallFn.apply(t, _splits(t, splits, ps.size()), ps, name)
    return out if splits is None else (out, received)


def alltoall_async(tensor, splits=None, name=None, process_set=None) -> Handle:
    ps = _basics.resolve(process_set)
    t = _tensor("hvd.alltoall_async", tensor)
    s = _splits(t, splits, ps.size())
    return _submit(lambda: C.alltoall_body(t, s, ps) if splits is not None else C.alltoall_body(t, s, ps)[0], name)


def _rs_check(tensor: torch.Tensor, op: int) -> None:
    if tensor.dim() == 0:
        raise ValueError("hvd.reducescatter needs a tensor with at least one dimension, got a scalar.")
    if op == Adasum:
        raise HorovodInternalError("hvd.reducescatter does not support op=hvd.Adasum; use hvd.Sum or hvd.Average.")
    if op not in (Average, Sum):
        raise HorovodInternalError(f"hvd.reducescatter supports hvd.Sum and hvd.Average, got {C.OP_NAMES[op]}.")


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, pre, post, ps, name):
        ctx.args = (op, ps)
        return synchronize(_submit(lambda: C.reducescatter_body(tensor, op, pre, post, ps), name))

    @staticmethod
    def backward(ctx, grad):
        op, ps = ctx.args
        full, _ = synchronize(_submit(lambda: C.allgather_body(grad.contiguous(), ps), None))
        # Horovod's convention (its tests hold it): Sum's gradient is the gathered gradient times
        # the set's size, Average's the gathered gradient itself.
        return (full * ps.size() if op == Sum else full), None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, prescale_factor=1.0,
                  postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """Collective: call on every rank of the set. ``tensor`` reduced over the set; this member
    keeps its block of rows (the first ``rows % n`` members get one row more). Differentiable."""
    t, o, ps = _tensor("hvd.reducescatter", tensor), _op(None, op), _basics.resolve(process_set)
    _rs_check(t, o)
    compression = check_compressor(compression)
    wire, cctx = compression.compress(t)
    return compression.decompress(_ReducescatterFn.apply(wire, o, prescale_factor, postscale_factor, ps, name), cctx)


def reducescatter_async(tensor, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                        process_set=None) -> Handle:
    t, o, ps = _tensor("hvd.reducescatter_async", tensor), _op(None, op), _basics.resolve(process_set)
    _rs_check(t, o)
    return _submit(lambda: C.reducescatter_body(t, o, prescale_factor, postscale_factor, ps), name)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average, prescale_factor=1.0,
                          postscale_factor=1.0, process_set=None) -> list[torch.Tensor]:
    ts = [_tensor("hvd.grouped_reducescatter", t) for t in tensors]
    for t in ts:
        _rs_check(t, _op(None, op))
    return [reducescatter(t, None, compression, op, prescale_factor, postscale_factor, process_set) for t in ts]


def grouped_reducescatter_async(tensors, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                                process_set=None) -> Handle:
    ts, o, ps = [_tensor("hvd.grouped_reducescatter", t) for t in tensors], _op(None, op), _basics.resolve(process_set)
    for t in ts:
        _rs_check(t, o)
    return _submit(lambda: [C.reducescatter_body(t, o, prescale_factor, postscale_factor, ps) for t in ts], name)


def barrier(process_set=None) -> None:
    """Collective: call on every rank of the set. Return when all of them have called it (after
    this rank's queued operations, as in Horovod)."""
    ps = _basics.resolve(process_set)
    if ps.included():
        synchronize(_submit(lambda: C.barrier_body(ps), None))


def join(device: int = -1) -> int:
    """Collective: call on every rank. Until every rank has joined, this rank answers the others'
    allreduces with zeros (uneven data: ranks that ran out keep the rest going). Returns the rank
    that joined last, the same on every rank."""
    ps = _basics.global_process_set
    return synchronize(_submit(lambda: C.join_body(ps), None))

