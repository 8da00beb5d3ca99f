"""Labelled collectives: every collective dtrain issues goes through one ``Collectives``, which
records it for the stall watchdog and, in debug mode, checks it against the other ranks first;
mechanisms that communicate take this object, not the whole ``Context``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .. import _check as check
from ..diag import Tracker
from ..diag.checker import check_call, check_same
from ..errors import ConfigError
from ..world import World, WorldView

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "mean": dist.ReduceOp.SUM}


def check_tensor(what: str, tensor: Any) -> None:
    check.instance(what, tensor, torch.Tensor, "give a torch.Tensor (e.g. torch.tensor(loss_value))")


class Collectives(WorldView):
    """This rank's collectives over the default group, each recorded and (``debug``) checked: the
    ``Context``'s operations, each collective (call on every rank); with one process, the input."""

    def __init__(self, world: World, tracker: Tracker, *, debug: bool = False) -> None:
        self.world = world
        self.tracker = tracker  # heartbeat and recent collectives, read by the stall watchdog
        self.debug = debug  # check every collective across ranks before issuing it

    @contextlib.contextmanager
    def labelled(self, op: str, *tensors: Any) -> Iterator[None]:
        """Record (for the watchdog) and, in debug mode, check a collective before the block issues it."""
        call = self.tracker.enter(op, *tensors)
        try:
            if self.debug:
                check_call(self.world_size, call)
            yield
        finally:
            self.tracker.leave(call)

    def check_same(self, what: str, value: Any, *, fix: str) -> None:
        """Collective: call on every rank. CollectiveMismatch (listing each rank's value) unless
        ``value`` is equal on every rank."""
        check_same(self.world_size, what, value, fix=fix)

    def check_rank(self, what: str, rank: Any) -> None:
        check.integer(what, rank, minimum=0)
        if rank >= self.world_size:
            raise ConfigError(f"{what} is {rank}, outside ranks 0..{self.world_size - 1}; give a rank of this job.")

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        check_tensor("ctx.all_reduce", tensor)
        if op not in OPS:
            raise ConfigError(f"unknown reduce op {op!r}; choose one of: {', '.join(OPS)}.")
        if self.world.distributed:
            with self.labelled(f"all_reduce({op})", tensor):
                dist.all_reduce(tensor, op=OPS[op])
            if op == "mean":
                tensor.div_(self.world_size)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        check_tensor("ctx.all_gather", tensor)
        if not self.world.distributed:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self.labelled("all_gather", tensor):
            dist.all_gather(out, tensor)
        return out

    def gather_object(self, obj: Any, dst: int | None = None) -> list[Any] | None:
        if dst is not None:
            self.check_rank("ctx.gather_object(obj, dst=...)", dst)
        if not self.world.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        if dst is None:
            with self.labelled("all_gather_object"):
                dist.all_gather_object(out, obj)
            return out
        with self.labelled(f"gather_object(dst={dst})"):
            dist.gather_object(obj, out if self.rank == dst else None, dst=dst)
        return out if self.rank == dst else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        check_tensor("ctx.broadcast", tensor)
        self.check_rank("ctx.broadcast(tensor, src=...)", src)
        if self.world.distributed:
            with self.labelled(f"broadcast(src={src})", tensor):
                dist.broadcast(tensor, src=src)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self.check_rank("ctx.broadcast_object(obj, src=...)", src)
        if not self.world.distributed:
            return obj
        box = [obj]
        with self.labelled(f"broadcast_object(src={src})"):
            dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.world.distributed:
            with self.labelled("barrier"):
                dist.barrier()
