"""``hvd.init``/``shutdown``, ranks and sizes, and process sets."""

from __future__ import annotations

import atexit
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import dtrain
from dtrain import ConfigError
from dtrain.world import destroy_process_group

from ._engine import Engine


class ProcessSet:
    """A subset of ranks that runs collectives among themselves (a torch process group)."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks = sorted(int(r) for r in ranks) if ranks is not None else None
        self.process_set_id: int | None = None
        self.group: Any = None  # the process group the data travels on

    def size(self) -> int:
        return len(self.ranks) if self.ranks is not None else size()

    def rank(self) -> int:
        """This process's rank within the set, or -1 when it is not a member."""
        if self.ranks is None:
            return rank()
        return self.ranks.index(rank()) if rank() in self.ranks else -1

    def included(self) -> bool:
        return self.rank() >= 0

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _State:
    ctx: dtrain.Context | None = None
    active = False
    engine: Engine | None = None
    sets: dict[int, ProcessSet] = {}
    next_id = 1
    own_group = False


global_process_set = ProcessSet()
global_process_set.process_set_id = 0


def _timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", 1800)))


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job's process group (rank and size from ``dtrain run``, torchrun or SLURM). Collective."""
    if comm is not None:
        _unsupported("init(comm=...) (MPI communicators)")
    if _State.active:
        return
    if _State.ctx is None:
        _State.ctx = dtrain.init("single", timeout_s=_timeout().total_seconds())
        if not _State.ctx.world.distributed:
            # One process: a private one-rank group, so every collective below runs unchanged.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            _State.own_group = True
        global_process_set.group = dist.new_group(backend=None, timeout=_timeout())
        atexit.register(_close)
    _State.engine = Engine()
    _State.active = True
    for ps in process_sets or []:
        add_process_set(ps)


def shutdown() -> None:
    """Leave Horovod's API. The process group itself stays until the process exits (torch cannot
    build a new default group on the launcher's store), so a later ``hvd.init()`` is cheap."""
    if not _State.active:
        return
    assert _State.engine is not None
    _State.engine.stop()
    _State.engine = None
    _State.active = False
    for ps in list(_State.sets.values()):
        remove_process_set(ps)
    if _State.ctx is not None and not _State.ctx.world.distributed:
        _close()


def _close() -> None:
    if _State.engine is not None:
        _State.engine.stop()
        _State.engine = None
    _State.active = False
    if _State.ctx is not None:
        if global_process_set.group is not None and dist.is_initialized():
            dist.destroy_process_group(global_process_set.group)
        global_process_set.group = None
        if _State.own_group:
            destroy_process_group()
        _State.own_group = False
        _State.ctx.close()
        _State.ctx = None


def is_initialized() -> bool:
    return _State.active


def _world() -> dtrain.World:
    if not _State.active or _State.ctx is None:
        raise ConfigError("Horovod has not been initialized; call hvd.init() first.")
    return _State.ctx.world


def engine() -> Engine:
    _world()
    assert _State.engine is not None
    return _State.engine


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


def is_homogeneous() -> bool:
    return True


def device() -> torch.device:
    return _world().device


# -- process sets ---------------------------------------------------------------------------
def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Collective: call on every rank, with the same ranks. A new set of ranks."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    n = size()
    if ps.ranks is None or not ps.ranks or any(not 0 <= r < n for r in ps.ranks) or len(set(ps.ranks)) != len(ps.ranks):
        raise ValueError(f"process set ranks {ps.ranks} must be distinct ranks of this job (0..{n - 1}).")
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} has already been added; add a process set once.")
    for other in _State.sets.values():
        if other.ranks == ps.ranks:
            raise ValueError(f"a process set with ranks {ps.ranks} exists already ({other}); reuse it.")
    engine().drain()  # one process too runs on a (private, one-rank) group
    ps.group = dist.new_group(ps.ranks, timeout=_timeout())
    ps.process_set_id = _State.next_id
    _State.next_id += 1
    _State.sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Collective: call on every rank. Free a set made by ``add_process_set``."""
    if process_set is global_process_set or process_set.process_set_id not in _State.sets:
        return False
    if _State.engine is not None:
        _State.engine.drain()
    g = process_set.group
    if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(g)
    del _State.sets[process_set.process_set_id]
    process_set.process_set_id = process_set.group = None
    return True


def get_process_set_ids_and_ranks() -> dict[int, list[int]]:
    out = {0: list(range(size()))}
    out.update({i: list(ps.ranks or []) for i, ps in _State.sets.items()})
    return out


def resolve(process_set: Any) -> ProcessSet:
    if process_set is None:
        return global_process_set
    if not isinstance(process_set, ProcessSet):
        raise ConfigError(f"process_set must be an hvd.ProcessSet, got {type(process_set).__name__}; "
                          "make one with hvd.add_process_set([ranks]).")
    if process_set is not global_process_set and process_set.process_set_id not in _State.sets:
        raise ValueError(f"{process_set} has not been added (or was removed); call hvd.add_process_set first.")
    return process_set


def _unsupported(what: str) -> None:
    raise ConfigError(f"Horovod feature not supported by dtrain.compat.horovod: {what}; "
                      "see the README's compat section for what is.")
