"""Several parallelisms at once, from one ``ParallelDims`` (``dtrain.init(parallel=...)``,
``--parallel dp_shard=2,tp=2``): the mesh is built once, and ``dtrain.parallel.apply.compose``
applies tensor parallelism, activation checkpointing, compile and FSDP/DDP in that order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..parallel import apply as par
from ..parallel.clip import clip_grad_norm_
from ..parallel.dims import ParallelDims, resolve
from ..world import World
from . import register
from .base import Capabilities, Strategy
from .fsdp import FSDPConfig


@register("composed")
class ComposedStrategy(Strategy):
    name = "composed"
    # TP's layers all-reduce in forward and FSDP all-gathers (every rank runs every forward);
    # parameters are DTensors; every rank saves its pieces through torch.distributed.checkpoint.
    capabilities = Capabilities(collective_forward=True, sharded_params=True, sharded_state=True)

    def __init__(self, parallel: str | dict | ParallelDims = "dp_replicate=1", *, tp_plan: Callable[[nn.Module, int], dict] | None = None,
                 compile: bool = False, activation_checkpointing: bool = False, fsdp: FSDPConfig | None = None) -> None:
        self.dims = resolve(parallel)
        par.check_supported(self.dims)
        if tp_plan is not None and not callable(tp_plan):
            raise ConfigError(f"tp_plan is a {type(tp_plan).__name__}; give a function (model, tp) -> {{name: ParallelStyle}}.")
        self.tp_plan, self.compile, self.activation_checkpointing = tp_plan, compile, activation_checkpointing
        self.fsdp = fsdp
        self.mesh: Any = None
        self._replaced: dict[int, nn.Parameter] = {}

    def __repr__(self) -> str:
        return f"ComposedStrategy({self.dims})"

    def setup_model(self, model: nn.Module, world: World, blocks: list[nn.Module] | None = None) -> nn.Module:
        """Collective: call on every rank."""
        self.dims.check_world(world.size)
        if self.activation_checkpointing and not blocks:
            raise ConfigError("--activation-checkpointing needs the model's blocks; pass ctx.setup(..., blocks=[...]) or set Task.blocks.")
        if self.mesh is None:
            self.mesh = self.dims.build_mesh(world.device.type)
        before = dict(model.named_parameters())
        model = par.compose(model, self.dims, self.mesh, world.device, blocks=blocks, plan=self.tp_plan,
                            activation_checkpointing=self.activation_checkpointing, compile=self.compile, fsdp=self.fsdp)
        after = dict(model.named_parameters())
        self._replaced.update({id(p): after[n] for n, p in before.items() if n in after})
        return model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """Point the optimizer at the DTensor parameters TP and FSDP put in place of the ones
        it was built on (as the fsdp strategy does)."""
        if any(optimizer.state.values()):
            raise ConfigError(f"composed: the {type(optimizer).__name__} already holds state; build it fresh, call ctx.setup, then load a checkpoint.")
        for group in optimizer.param_groups:
            group["params"] = [self._replaced.get(id(p), p) for p in group["params"]]
        return optimizer

    def data_parallel(self, world: World) -> tuple[int, int]:
        """Ranks of one TP group (and of one pipeline) read the same batch."""
        return self.dims.dp_rank(world.rank), self.dims.dp

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The norm over every dimension's pieces (one all-reduce). Collective."""
        return clip_grad_norm_(list(parameters), max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        setter = getattr(model, "set_requires_gradient_sync", None)  # fully_shard / replicate
        if setter is None:
            yield
            return
        setter(False)
        try:
            yield
        finally:
            setter(True)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # every step changes the module in place

    def comm_payload_bytes(self, model: nn.Module) -> None:
        """Unknown (``dtrain bench`` shows '-'): TP's all-reduces carry activations, whose size
        depends on the batch, beside FSDP's or DDP's gradient traffic."""
        return None


def strategy_for(strategy: Any, parallel: Any, world_size: int, options: dict[str, Any], *,
                 compile: bool, activation_checkpointing: bool) -> tuple[str, dict[str, Any]]:
    """The strategy (name, options) that runs the layout ``parallel``. A layout of one kind is
    today's strategy (``dp_replicate=N``: ddp, ``dp_shard=N``: fsdp, both: hsdp, ``pp=N``:
    pipeline), so it runs exactly as before; a layout with tp is the composed strategy, which
    then applies compile and activation checkpointing itself, in its order."""
    dims = resolve(parallel)
    if strategy not in ("auto", "composed"):
        raise ConfigError(f"parallel={dims} and strategy={strategy!r} both say how to split the ranks; drop one "
                          "(a strategy name is a layout: ddp = all dp_replicate, fsdp = all dp_shard, pipeline = pp).")
    dims.check_world(world_size)
    options = dict(options)
    plan = options.pop("tp_plan", None)
    if dims.tp == 1 and dims.pp == 1 and dims.dp_shard == 1:
        return ("ddp" if world_size > 1 else "single"), options
    if dims.tp == 1 and dims.pp == 1 and dims.dp_replicate == 1:
        return "fsdp", options
    if dims.tp == 1 and dims.pp == 1:
        return "hsdp", {**options, "shard_size": dims.dp_shard}
    if dims.pp == world_size:
        return "pipeline", options
    try:  # fsdp's options (wrap, ...) apply to the dp_shard step
        fsdp = FSDPConfig(**options) if options else None
    except TypeError:
        raise ConfigError(f"parallel={dims} takes the fsdp options (wrap, offload, reshard_after_forward) and tp_plan; "
                          f"drop {', '.join(sorted(options))}.") from None
    return "composed", {"parallel": dims, "tp_plan": plan, "compile": compile,
                        "activation_checkpointing": activation_checkpointing, "fsdp": fsdp}
