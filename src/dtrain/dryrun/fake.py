"""torch's fake process group (as torchtitan's ``--comm.mode fake_backend``): every collective returns
at once without moving data, so one rank of any world runs its real program alone; the values are
wrong, the shapes, memory and calls are the real ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..world import World


def world_of(rank: int, size: int, local_size: int, device: torch.device) -> World:
    """Rank ``rank`` of ``size`` processes, ``local_size`` per node, on this machine's ``device``."""
    return World(rank=rank, local_rank=rank % local_size, size=size, local_size=local_size, node_rank=rank // local_size,
                 device=device, backend="fake", source="dryrun")


@contextlib.contextmanager
def fake_group(world: World) -> Iterator[None]:
    """This process as ``world.rank`` of a fake group of ``world.size``, left at the end."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("a process group is already initialised in this process; run the dry run in a process of its own "
                          "(the dtrain dry-run command, or dtrain.dryrun.dry_run before dtrain.init).")
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)
    dist.init_process_group("fake", store=FakeStore(), rank=world.rank, world_size=world.size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_ddp_hook(model: nn.Module) -> None:
    """Under the fake group, give DDP an all-reduce hook that returns its bucket itself: the
    built-in one reads the result from the work's future, which the fake group leaves empty."""
    from torch.nn.parallel import DistributedDataParallel

    from ..context.step import inner_module

    ddp = inner_module(model)
    if dist.get_backend() == "fake" and isinstance(ddp, DistributedDataParallel):
        ddp.register_comm_hook(ddp.process_group, _all_reduce_in_place)


def _all_reduce_in_place(group, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations; none here
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    dist.all_reduce(buf, group=group)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(buf)
    return done
