"""What one rank's steps hold and send, counted the same way in a dry run and in a real run, by
dispatch modes: live tensor storages and their peak (torch's MemTracker mechanism, without its
one-iteration limit), and each collective by kind, mesh dimension and bytes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``t``'s data: a DTensor's local shard, a plain tensor's own."""
    from torch.distributed._tools.common_utils import get_untyped_storages

    return [s for s in get_untyped_storages(t) if s.device.type != "meta"]


def _is_dtensor(types: Iterable[type]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(issubclass(t, DTensor) for t in types)


class TensorMemory(TorchDispatchMode):
    """Live bytes of the tensors this rank holds, and their peak, while entered. ``hold``
    registers what exists before (parameters, gradients, optimizer state)."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: list[weakref.ref] = []
        self.live = 0
        self.peak = 0
        self._resize: Callable[..., Any] | None = None

    def hold(self, tensors: Iterable[Any]) -> None:
        for t in tensors:
            if torch.is_tensor(t):
                for st in _storages(t):
                    self._add(st)

    def _add(self, st: torch.UntypedStorage) -> None:
        if st in self._sizes:
            return
        size = st.nbytes()
        self._sizes[st] = [size]
        cell = self._sizes[st]
        self._refs.append(weakref.ref(st, lambda _ref, cell=cell: self._freed(cell)))
        self._grow(size)

    def _freed(self, cell: list[int]) -> None:
        self.live -= cell[0]
        cell[0] = 0

    def _grow(self, delta: int) -> None:
        self.live += delta
        self.peak = max(self.peak, self.live)

    def _resized(self, st: torch.UntypedStorage) -> None:
        cell = self._sizes.get(st)
        if cell is None:  # made before we looked (e.g. FSDP2's all-gather buffer, sized 0 then)
            self._add(st)
            return
        delta = st.nbytes() - cell[0]
        cell[0] = st.nbytes()
        self._grow(delta)

    def __enter__(self) -> TensorMemory:
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = original(st, size)
            if st.device.type != "meta":
                tracker._resized(st)
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._resize is not None:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
            self._resize = None
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if _is_dtensor(types):
            return NotImplemented  # let DTensor run its local ops, which come back here (as MemTracker does)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._add(st)
        return out


KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast", "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv", "barrier": "barrier", "monitored_barrier_": "barrier",
}
"""c10d and functional collective ops (``torch.ops.c10d``, ``torch.ops._c10d_functional``) by kind."""


@dataclass(frozen=True)
class Call:
    kind: str
    dim: str
    bytes: int


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _group_name(args: tuple, kwargs: dict) -> str | None:
    """The process group a collective op runs on: functional ops take its name (their last
    string argument; a reduce op's name comes before it), c10d ops the group."""
    import torch.distributed as dist

    names = [a for a in list(args) + list(kwargs.values()) if isinstance(a, str)]
    if "group_name" in kwargs or names:
        return str(kwargs.get("group_name", names[-1]))
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).group_name
            except (RuntimeError, TypeError, AttributeError):
                continue
    return None


class CollectiveLog(TorchDispatchMode):
    """Each collective this rank issues while entered (``calls``), its bytes the largest buffer it
    touches: an all-gather's gathered output, a reduce-scatter's whole input, an all-reduce's
    tensor (the size NCCL's tests report). ``dims`` names a group: {group name: mesh dimension}."""

    def __init__(self, dims: Callable[[], dict[str, str]]) -> None:
        super().__init__()
        self._dims = dims
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace = getattr(func, "namespace", "")
        if namespace in ("c10d", "_c10d_functional"):
            op = func.__name__.split(".")[0]
            kind = KINDS.get(op)
            if kind is not None:
                size = max([_nbytes(a) for a in args] + [_nbytes(out)])
                name = _group_name(args, kwargs)
                self.calls.append(Call(kind, self._dims().get(name or "", name or "?"), size))
        return out

    @contextlib.contextmanager
    def span(self) -> Iterator[list[Call]]:
        """The calls made inside the block."""
        start = len(self.calls)
        out: list[Call] = []
        try:
            yield out
        finally:
            out.extend(self.calls[start:])


def summarise(calls: Iterable[Call]) -> list[dict[str, Any]]:
    """Calls grouped by (kind, dimension): count and bytes (total), in first-seen order."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for c in calls:
        g = groups.setdefault((c.kind, c.dim), {"kind": c.kind, "dim": c.dim, "count": 0, "bytes": 0})
        g["count"] += 1
        g["bytes"] += c.bytes
    return list(groups.values())
