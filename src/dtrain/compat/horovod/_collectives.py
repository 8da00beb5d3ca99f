"""The collectives themselves, as run on the engine thread: negotiate, then move the bytes. Every
dtype travels: those gloo cannot reduce are reduced in a wider type; gathers move raw bytes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _basics
from ._engine import DTYPES, KINDS, HorovodInternalError, MismatchError, describe, exchange

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
_TORCH_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
              Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
_WIDER = {torch.int16: torch.int32, torch.bool: torch.int32}

_rounds: dict[int, int] = {}  # negotiation rounds per process set: the same on every member


def _device(t: torch.Tensor | None):
    return t.device if t is not None else _basics.device()


def _describe_row(row: torch.Tensor) -> str:
    kind = {v: k for k, v in KINDS.items()}.get(int(row[0]), "?")
    if kind == "join":
        return "join"
    dtype = DTYPES[int(row[1])] if 0 <= int(row[1]) < len(DTYPES) else "?"
    shape = [int(s) for s in row[6:6 + max(int(row[2]), 0)]]
    return f"{kind}({str(dtype).replace('torch.', '')}{shape}, arg={int(row[3])})"


def negotiate(kind: str, tensor: torch.Tensor | None, ps, arg: int = 0, joined_at: int = -1) -> torch.Tensor:
    """Every member's description of this operation; raises the same error on every rank that is
    not in ``join`` when they disagree."""
    n = ps.size()
    key = ps.process_set_id or 0
    _rounds[key] = _rounds.get(key, 0) + 1
    if joined_at == -2:
        joined_at = _rounds[key]
    rows = exchange(describe(kind, tensor, arg, joined_at), ps.group, n, _device(tensor))
    if kind in ("join", "barrier"):
        return rows
    joined = rows[:, 0] == KINDS["join"]
    active = rows[~joined]
    where = ps.ranks or list(range(n))
    waiting = [where[i] for i in range(n) if int(rows[i, 0]) == KINDS["barrier"]]
    if waiting:
        raise HorovodInternalError(f"hvd.{kind} cannot run: rank(s) {waiting} wait in hvd.barrier(); every rank of "
                                   "the process set must call the same operations in the same order.")
    if joined.any() and kind != "allreduce":
        gone = [where[i] for i in range(n) if joined[i]]
        raise HorovodInternalError(f"hvd.{kind} needs every rank, but rank(s) {gone} have called hvd.join(); "
                                   "only allreduce continues past a joined rank.")
    ignore_dim0 = kind in ("allgather", "alltoall")
    ref = active[0]
    for row in active[1:]:
        same = bool(row[0] == ref[0]) and bool(row[1] == ref[1]) and bool(row[2] == ref[2]) and bool(row[3] == ref[3])
        lo = 7 if ignore_dim0 else 6
        same = same and torch.equal(row[lo:], ref[lo:]) and (ignore_dim0 or bool(row[5] == ref[5]))
        if not same:
            detail = "; ".join(f"rank {where[i]}: {_describe_row(rows[i])}" for i in range(n))
            raise MismatchError(f"ranks disagree on hvd.{kind}: {detail}; every rank must pass the same "
                                "operation, dtype, shape (beyond the first dimension for allgather/alltoall) and root.")
    return rows


# -- reductions -----------------------------------------------------------------------------
def scale(t: torch.Tensor, factor: float, dtype: torch.dtype) -> torch.Tensor:
    """``t * factor`` in ``dtype``, computed as Horovod does: integers in float64, half in float32."""
    if factor == 1.0:
        return t
    if not dtype.is_floating_point:
        return (t.double() * factor).to(t.dtype)
    if dtype in (torch.float16, torch.bfloat16) and t.device.type == "cpu":
        return (t.float() * factor).to(t.dtype)
    return t * factor


def _adasum(buf: torch.Tensor, ps) -> torch.Tensor:
    """Adasum (Maleki et al., arXiv 2006.02924): combine pairs a, b as
    (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b, recursively over ranks (a binary tree)."""
    n = ps.size()
    parts = [torch.empty_like(buf) for _ in range(n)]
    dist.all_gather(parts, buf.contiguous(), group=ps.group)
    vecs = [p.double().reshape(-1) for p in parts]
    while len(vecs) > 1:
        nxt = []
        for i in range(0, len(vecs) - 1, 2):
            a, b = vecs[i], vecs[i + 1]
            dot, aa, bb = a @ b, a @ a, b @ b
            ca = 1 - dot / (2 * aa) if aa > 0 else 1.0
            cb = 1 - dot / (2 * bb) if bb > 0 else 1.0
            nxt.append(ca * a + cb * b)
        if len(vecs) % 2:
            nxt.append(vecs[-1])
        vecs = nxt
    return vecs[0].reshape(buf.shape).to(buf.dtype)


def reduce_body(buf: torch.Tensor, op: int, ps) -> torch.Tensor:
    """Sum/min/max/product (or Adasum) of ``buf`` over the set, in a dtype the backend reduces."""
    wire = _WIDER.get(buf.dtype, torch.float32 if buf.dtype == torch.bfloat16 and buf.device.type == "cpu" else buf.dtype)
    work = buf.to(wire) if wire != buf.dtype else buf.clone()
    if op == Adasum:
        work = _adasum(work, ps)
    else:
        dist.all_reduce(work, op=_TORCH_OPS[op], group=ps.group)
    if buf.dtype == torch.bool:
        return work != 0
    return work.to(buf.dtype)


def allreduce_body(tensor: torch.Tensor, op: int, pre: float, post: float, ps) -> torch.Tensor:
    negotiate("allreduce", tensor, ps, op)
    out = reduce_body(scale(tensor.detach(), pre, tensor.dtype), op, ps)
    return scale(_averaged(out, op, ps.size()), post, tensor.dtype)


def _averaged(out: torch.Tensor, op: int, n: int) -> torch.Tensor:
    """A sum over ``n`` members divided by ``n`` for ``Average`` (integers truncated, as Horovod does)."""
    if op != Average:
        return out
    return out / n if out.is_floating_point() else torch.div(out, n, rounding_mode="trunc")


def barrier_body(ps) -> None:
    """Return once every member has reached ``barrier`` (a rank in ``join`` counts as there); the
    members still in other operations fail them meanwhile, so ranks that went apart meet again here."""
    while True:
        rows = negotiate("barrier", None, ps)
        if all(int(k) in (KINDS["barrier"], KINDS["join"]) for k in rows[:, 0]):
            return


def allreduce_in_place(t: torch.Tensor, op: int, pre: float, post: float, ps) -> bool:
    """The common case without copies (DistributedOptimizer's fused buffers): a contiguous
    float32/float64 tensor, Sum or Average, no scaling, reduced where it is. False: not handled."""
    if not (pre == post == 1.0 and op in (Sum, Average) and t.dtype in (torch.float32, torch.float64)
            and t.is_contiguous()):
        return False
    negotiate("allreduce", t, ps, op)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=ps.group)
    if op == Average:
        t.div_(ps.size())
    return True


def join_body(ps) -> int:
    """Answer other ranks' allreduces with zeros until every rank has joined; the last to join."""
    mine = -2  # negotiate fills in this round's number
    while True:
        rows = negotiate("join", None, ps, joined_at=mine)
        if mine == -2:
            mine = _rounds[ps.process_set_id or 0]
        joined = rows[:, 0] == KINDS["join"]
        if joined.all():
            at = rows[:, 4]
            return int(max(range(len(at)), key=lambda i: (int(at[i]), i)))
        active = rows[~joined]
        if int(active[0, 0]) != KINDS["allreduce"] or any(not torch.equal(r, active[0]) for r in active[1:]):
            continue  # the other ranks raise; nothing travels
        ref = active[0]
        shape = [int(s) for s in ref[6:6 + int(ref[2])]]
        zeros = torch.zeros(shape, dtype=DTYPES[int(ref[1])], device=_basics.device())
        reduce_body(zeros, int(ref[3]), ps)


# -- data movement --------------------------------------------------------------------------
def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _gather_bytes(t: torch.Tensor, counts: list[int], ps) -> list[torch.Tensor]:
    """Every member's bytes of ``t`` (``counts`` bytes each)."""
    mine = _as_bytes(t)
    width = max(max(counts), 1)
    padded = torch.zeros(width, dtype=torch.uint8, device=mine.device)
    padded[: mine.numel()] = mine
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=ps.group)
    return [p[:c] for p, c in zip(parts, counts)]


def allgather_body(tensor: torch.Tensor, ps) -> tuple[torch.Tensor, list[int]]:
    rows = negotiate("allgather", tensor, ps)
    t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    item = t.element_size()
    counts = [int(r[5]) * item for r in rows]
    parts = _gather_bytes(t, counts, ps)
    dims0 = [int(r[6]) if int(r[2]) > 0 else 1 for r in rows]  # a scalar gathers as one row
    data = torch.cat(parts).view(t.dtype) if t.dtype != torch.uint8 else torch.cat(parts)
    return data.reshape(sum(dims0), *t.shape[1:]), dims0


def broadcast_body(tensor: torch.Tensor, root: int, ps) -> torch.Tensor:
    negotiate("broadcast", tensor, ps, root)
    out = tensor.detach().clone().contiguous()
    dist.broadcast(_as_bytes(out) if out.dtype != torch.uint8 else out.view(-1), src=root, group=ps.group)
    return out


def alltoall_body(tensor: torch.Tensor, splits: torch.Tensor, ps) -> tuple[torch.Tensor, torch.Tensor]:
    rows = negotiate("alltoall", tensor, ps)
    n, me = ps.size(), ps.rank()
    all_splits = [torch.empty(n, dtype=torch.int64, device=tensor.device) for _ in range(n)]
    dist.all_gather(all_splits, splits.to(device=tensor.device, dtype=torch.int64), group=ps.group)
    table = torch.stack(all_splits).cpu()
    item = tensor.element_size()
    counts = [int(r[5]) * item for r in rows]
    parts = _gather_bytes(tensor, counts, ps)
    row_bytes = tensor[0].numel() * item if tensor.dim() > 0 and tensor.shape[0] else 0
    mine = []
    for j in range(n):
        start = int(table[j, :me].sum()) * row_bytes
        mine.append(parts[j][start: start + int(table[j, me]) * row_bytes])
    data = torch.cat(mine)
    data = data.view(tensor.dtype) if tensor.dtype != torch.uint8 else data
    received = table[:, me].to(torch.int32)
    return data.reshape(int(received.sum()), *tensor.shape[1:]), received


def reducescatter_rows(total: int, n: int) -> list[int]:
    """How Horovod splits the first dimension: the first ``total % n`` ranks get one row more."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def reducescatter_body(tensor: torch.Tensor, op: int, pre: float, post: float, ps) -> torch.Tensor:
    negotiate("reducescatter", tensor, ps, op)
    n, me = ps.size(), ps.rank()
    summed = reduce_body(scale(tensor.detach(), pre, tensor.dtype), Sum, ps)
    split = reducescatter_rows(tensor.shape[0], n)
    out = summed[sum(split[:me]): sum(split[: me + 1])].clone()
    return scale(_averaged(out, op, n), post, tensor.dtype)
