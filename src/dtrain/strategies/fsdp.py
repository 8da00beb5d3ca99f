"""Fully sharded data parallel with torch's ``fully_shard`` (FSDP2): parameters, gradients and
optimizer state sharded over ranks (ZeRO stage 3; Zhao et al., "PyTorch FSDP", VLDB 2023).

Each wrapped unit's parameters become DTensors holding 1/N of every tensor (dim 0). Before a
unit's forward its parameters are all-gathered, and freed again after it; its gradients are
reduce-scattered in backward. ``fully_shard`` registers new (DTensor) parameters, so the
optimizer, built on the model's parameters before ``ctx.setup``, has its parameter groups
pointed at the new ones by name (``setup_optimizer``); its state then covers the shards only.

``hsdp`` is the same on a 2-D mesh (Hybrid Sharded DP): sharded over the ranks of a node,
replicated across nodes (gradients reduce-scattered within a node, then all-reduced across).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._log import note_once
from ..errors import ConfigError
from ..parallel.dims import ParallelDims
from ..parallel.fsdp import FSDPConfig, apply_fully_shard, parse_wrap, units
from ..world import World
from . import register
from .base import Capabilities, Strategy


def _check_no_buffers_sync(model: nn.Module, name: str) -> None:
    if any(True for _ in model.buffers()):
        note_once(f"{name}: buffers (e.g. BatchNorm statistics) are not synchronised across ranks by fully_shard.")


class _ShardedStrategy:
    """Shared steps of fsdp and hsdp, as a component (each strategy holds one)."""

    def __init__(self, name: str, config: FSDPConfig) -> None:
        self.name, self.config = name, config
        self._replaced: dict[int, nn.Parameter] = {}
        """id of a parameter before fully_shard -> the sharded parameter that replaced it."""

    def setup(self, model: nn.Module, world: World, mesh: DeviceMesh, blocks: list[nn.Module] | None = None) -> nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(f"{self.name}: the model has no trainable parameters; nothing to shard.")
        _check_no_buffers_sync(model, self.name)
        before = dict(model.named_parameters())
        model = apply_fully_shard(model, mesh, self.config, world.device, blocks)
        after = dict(model.named_parameters())
        self._replaced.update({id(p): after[name] for name, p in before.items()})
        return model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point the optimizer's parameter groups at the sharded parameters that replaced the
        ones it was built on (torch's FSDP2 expects the optimizer built after ``fully_shard``)."""
        if not self._replaced:
            return optimizer
        if any(optimizer.state.values()):
            raise ConfigError(f"{self.name}: the {type(optimizer).__name__} already holds state; build it fresh, "
                              "call ctx.setup, then load a checkpoint.")
        for group in optimizer.param_groups:
            group["params"] = [self._replaced.get(id(p), p) for p in group["params"]]
        return optimizer

    def comm_payload_bytes(self, model: nn.Module) -> int:
        """Unsharded bytes through collectives per step: the parameters all-gathered for forward
        (and again for backward when resharded after forward), the gradients reduce-scattered."""
        full = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)  # DTensor: global size
        return full * (3 if self.config.reshard_after_forward else 2)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        setter = getattr(model, "set_requires_gradient_sync", None)
        if setter is None:
            yield
            return
        setter(False)  # gradients accumulate unsharded, locally; reduced on the window's last step
        try:
            yield
        finally:
            setter(True)


@register("fsdp")
class FSDPStrategy(Strategy):
    name = "fsdp"
    # Every forward all-gathers parameters; parameters are DTensor shards; checkpoints go through
    # torch.distributed.checkpoint. ``blocks`` (setup_model) are the units when no wrap policy is given.
    capabilities = Capabilities(collective_forward=True, sharded_params=True, sharded_state=True)

    def __init__(self, config: FSDPConfig | None = None, **options) -> None:
        self.config = config or FSDPConfig(**options)
        if self.config.shard_size is not None:
            raise ConfigError("shard_size is an hsdp option; use --strategy hsdp, or drop it for fsdp.")
        self._impl = _ShardedStrategy(self.name, self.config)

    def setup_model(self, model: nn.Module, world: World, blocks: list[nn.Module] | None = None) -> nn.Module:
        if not world.distributed:
            note_once("fsdp with one process: nothing to shard; running the model as it is.")
            return model.to(world.device)
        mesh = ParallelDims(dp_shard=world.size).build_mesh(world.device.type)["dp_shard"]
        return self._impl.setup(model, world, mesh, blocks)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        return self._impl.setup_optimizer(optimizer)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return self._impl.no_sync(model)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard changes the module in place; there is no wrapper

    def comm_payload_bytes(self, model: nn.Module) -> int:
        return self._impl.comm_payload_bytes(model)


@register("hsdp")
class HSDPStrategy(Strategy):
    name = "hsdp"
    capabilities = Capabilities(collective_forward=True, sharded_params=True, sharded_state=True)

    def __init__(self, config: FSDPConfig | None = None, **options) -> None:
        self.config = config or FSDPConfig(**options)
        self._impl = _ShardedStrategy(self.name, self.config)

    def mesh_shape(self, world: World) -> tuple[int, int]:
        """(replicas, shards): replicated across nodes, sharded within one."""
        shard = self.config.shard_size or world.local_size
        if shard > world.size or world.size % shard:
            raise ConfigError(
                f"hsdp: {world.size} processes cannot be split into groups of {shard} (shard_size); "
                f"use a shard size that divides {world.size}."
            )
        return world.size // shard, shard

    def setup_model(self, model: nn.Module, world: World, blocks: list[nn.Module] | None = None) -> nn.Module:
        if not world.distributed:
            note_once("hsdp with one process: nothing to shard; running the model as it is.")
            return model.to(world.device)
        shape = self.mesh_shape(world)
        try:
            dims = ParallelDims(dp_replicate=shape[0], dp_shard=shape[1])
            mesh = dims.build_mesh(world.device.type)["dp_replicate", "dp_shard"]
        except (RuntimeError, NotImplementedError, ValueError) as exc:  # a backend without 2-D meshes
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"hsdp: torch cannot build a {shape[0]}x{shape[1]} device mesh on backend {world.backend} ({first}); use --strategy fsdp.") from None
        return self._impl.setup(model, world, mesh, blocks)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        return self._impl.setup_optimizer(optimizer)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return self._impl.no_sync(model)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model


__all__ = ["FSDPConfig", "FSDPStrategy", "HSDPStrategy", "apply_fully_shard", "parse_wrap", "units"]
