"""torch's DistributedDataParallel, its all-reduce swappable for a ``dtrain.comm`` method (``comm=``):
the layout ``dp_replicate`` = every process, replicated by ``DDPReplicas`` (which also serves a
``--parallel`` layout of replicas alone, and zero1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._log import logger, note_once
from ..comm import CommSpec, Method, attach, bucket_mb
from ..comm.methods import powersgd_numel
from ..errors import ConfigError
from ..parallel.dims import ParallelDims
from ..world import World
from . import register
from .layout import REPLICAS, LayoutStrategy


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    bucket_cap_mb: float = 25.0
    """Gradient bucket size handed to DistributedDataParallel."""
    find_unused_parameters: bool = False
    """Set when some parameters get no gradient in a step (costs a graph traversal per step)."""
    gradient_as_bucket_view: bool = True
    """Gradients alias the all-reduce buckets: one copy less, less memory."""
    broadcast_buffers: bool = True
    """Copy rank 0's buffers (e.g. BatchNorm statistics) to every rank at each forward."""
    static_graph: bool = False
    comm: CommSpec = CommSpec()
    """How gradients travel (``--comm``): all-reduce, compressed, PowerSGD, local SGD or auto."""

    def __post_init__(self) -> None:
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}.")


class DDPReplicas:
    """Replication by DDP over a group of replicas, with the ``--comm`` method and its state."""

    def __init__(self, config: DDPConfig) -> None:
        self.config = config
        self.comm: Method | None = None
        """The communication method attached to the DDP model (None: DDP's own all-reduce)."""
        self._world_size = 1
        self._pending: dict | None = None

    def wrap(self, model: nn.Module, world: World, group: Any = None) -> nn.Module:
        """``model`` on the device, in DDP over ``group`` (None: the default group).
        Collective: call on every rank (DDP broadcasts rank 0's parameters)."""
        model = model.to(world.device)
        if not world.distributed:
            note_once("ddp with one process: running without DistributedDataParallel (nothing to synchronise).")
            return model
        if not any(p.requires_grad for p in model.parameters()):
            note_once("ddp: the model has no trainable parameters, so it runs without DistributedDataParallel.")
            return model
        c = self.config
        extra = {} if c.broadcast_buffers else {"broadcast_buffers": False}  # deprecated name in torch>=2.13
        ddp = DistributedDataParallel(
            model,
            device_ids=[world.device.index] if world.device.type == "cuda" else None,
            process_group=group,
            bucket_cap_mb=bucket_mb(model, c.comm, c.bucket_cap_mb),
            find_unused_parameters=c.find_unused_parameters,
            gradient_as_bucket_view=c.gradient_as_bucket_view,
            static_graph=c.static_graph,
            **extra,
        )
        self._world_size = world.size
        self.comm = attach(ddp, c.comm)
        if self._pending is not None:
            self.load_state_dict(self._pending)
        return ddp

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        register = getattr(self.comm, "register_optimizer", None)
        if register is not None:  # local SGD keeps each rank's own optimizer state
            register(optimizer)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Collective: every rank, after each optimizer step (local SGD averages parameters here)."""
        if self.comm is not None:
            self.comm.after_step(optimizer)

    def payload_bytes(self, model: nn.Module) -> int:
        """Bytes one rank hands to collectives per step (amortised) as the ``--comm`` method sends them."""
        params = [p for p in model.parameters() if p.requires_grad]
        full = sum(p.numel() * p.element_size() for p in params)
        spec = self.config.comm
        if spec.kind == "auto":  # what it chose, once it has
            choice = getattr(self.comm, "choice", None)
            spec = CommSpec.parse(choice) if choice else CommSpec()
        if spec.kind in ("fp16", "bf16"):
            return sum(p.numel() * 2 for p in params)
        if spec.kind == "powersgd":
            compressed, whole = powersgd_numel([p.shape for p in params], spec.rank)
            return (compressed + whole) * 4  # the hook's buffers are fp32
        if spec.kind == "localsgd":
            return full // spec.period
        return full

    def record(self) -> dict:
        """For result records: ``comm`` as asked, and ``comm_choice``, what ran (auto's pick)."""
        spec = str(self.config.comm)
        if self.config.comm.kind == "auto":  # None until auto has decided (or with one process)
            return {"comm": spec, "comm_choice": getattr(self.comm, "choice", None)}
        return {"comm": spec, "comm_choice": spec}

    def state_dict(self) -> dict:
        """This rank's communication state (PowerSGD error feedback, step counters, auto's choice)."""
        return {"comm": str(self.config.comm), "world_size": self._world_size,
                "state": self.comm.state_dict() if self.comm is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.comm is None:
            self._pending = state  # restored when wrap attaches the method
            return
        self._pending = None
        if state.get("comm") != str(self.config.comm) or state.get("state") is None:
            logger.warning(f"the checkpoint's communication state is for --comm {state.get('comm')}; --comm {self.config.comm} starts afresh.")
            return
        self.comm.load_state_dict(state["state"], same_ranks=state.get("world_size") == self._world_size)


def replicas(world: World) -> ParallelDims:
    """Every process a replica of the whole model."""
    return ParallelDims(dp_replicate=world.size)


@register("ddp", capabilities=REPLICAS)
def ddp(config: DDPConfig | None = None, *, comm: str | CommSpec | None = None, comm_warmup: int | None = None,
        **options: Any) -> LayoutStrategy:
    """The layout ``dp_replicate=N``, replicated by DDP (with ``--comm``)."""
    if config is None:
        config = DDPConfig(comm=CommSpec.parse(comm, warmup=comm_warmup), **options)
    return LayoutStrategy("ddp", replicas, capabilities=REPLICAS, ddp=DDPReplicas(config))


__all__ = ["DDPConfig", "DDPReplicas", "ddp", "replicas"]
