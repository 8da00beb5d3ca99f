"""Each parallelism as one short function, applied by ``parallelize`` in one fixed order for every
strategy (docs/parallelism.md): pp (every later step applies to this rank's stage alone), float8
(before TP, which a later swap of its linears would undo), tp, ac, compile per block, then fsdp or
the strategy's replicate. The order is torchtitan's: FSDP, last, shards what TP left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from .._log import note_once
from ..errors import ConfigError
from ..precision import Precision
from . import transforms
from .dims import ParallelDims
from .float8 import apply_float8
from .fsdp import FSDPConfig, apply_fully_shard
from .pipeline import PipelineConfig, split_stage
from .placement import Placement
from .stages import Pipe, Stages


def apply_pp(model: nn.Module, place: Placement, config: PipelineConfig, blocks: Sequence[nn.Module]
             ) -> tuple[nn.Module, list[nn.Module]]:
    """Cut ``model`` (an ``nn.Sequential``) into the layout's ``pp`` stages between its blocks;
    returns this rank's stage and the blocks in it, and sets up its pipeline on ``place``.
    Collective: call on every rank."""
    whole = place.dims.pp == place.world.size
    stages = Stages.of_world(place.world) if whole else Stages.of_mesh(place["pp"])
    stage = split_stage(model, stages.index, stages.count, config, list(blocks) or None)
    inside = {id(m) for m in stage.modules()}
    place.pipe = Pipe(stages, config, place.world.device)
    place.stage_params = {id(p) for p in stage.parameters()}
    return stage, [b for b in blocks if id(b) in inside]


def apply_tp(model: nn.Module, tp_mesh: Any, plan: dict[str, Any]) -> nn.Module:
    """Split the plan's layers over ``tp_mesh`` (their weights become DTensors); in place.
    Parameters the model shares between layers (a head tied to the embedding) stay shared."""
    from torch.distributed.tensor.parallel import parallelize_module

    if not plan:
        raise ConfigError("--parallel tp>1: the task's tp_plan is empty; give {submodule name: ColwiseParallel()/RowwiseParallel()}.")
    names = dict(model.named_modules())
    missing = [n for n in plan if n not in names]
    if missing:
        raise ConfigError(f"the tensor-parallel plan names {', '.join(missing[:3])}, which the model does not have; "
                          f"plan keys are submodule names such as {next(iter(n for n in names if n), 'block0.mlp')}.")
    ties = tied_groups(model)
    model = parallelize_module(model, tp_mesh, plan)
    # parallelize_module gives each layer its own new parameter, which would train a tied pair as
    # two tensors: tie them again, if the plan split them alike.
    for names in ties:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            other = model.get_parameter(name)
            if other is not first and _layout(other) != _layout(first):
                raise ConfigError(f"the tensor-parallel plan splits the tied parameters {names[0]} ({_layout(first)}) and {name} "
                                  f"({_layout(other)}) differently; split both alike (vocabulary rows: RowwiseParallel embedding, "
                                  "ColwiseParallel head) or untie them (task lm: --task-arg tie=false).")
        retie(model, names)
    return model


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of the parameters that are one tensor (weight tying), grouped."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def retie(model: nn.Module, names: list[str]) -> None:
    """Point every name of a tie at the first name's parameter."""
    first = model.get_parameter(names[0])
    for name in names[1:]:
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, first)


def _layout(p: torch.Tensor) -> str:
    placements = getattr(p, "placements", None)
    return "whole" if placements is None else ",".join(map(str, placements))


def apply_ac(blocks: Sequence[nn.Module]) -> int:
    """Recompute each block's activations in backward (``dtrain.parallel.transforms``)."""
    return transforms.apply_activation_checkpointing(blocks)


def apply_compile(blocks: Sequence[nn.Module]) -> None:
    """``torch.compile`` each block in place (``Module.compile``: parameter names unchanged)."""
    for block in blocks:
        block.compile()


def apply_fsdp(model: nn.Module, dp_mesh: Any, device: torch.device, blocks: Sequence[nn.Module] | None,
               config: FSDPConfig | None = None, name: str = "fsdp", param_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard`` each block, then the root, over ``dp_mesh`` (2-D: HSDP), gathering
    parameters in ``param_dtype`` (None: fp32)."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"{name}: the model has no trainable parameters; nothing to shard.")
    if any(True for _ in model.buffers()):
        note_once(f"{name}: buffers (e.g. BatchNorm statistics) are not synchronised across ranks by fully_shard.")
    return apply_fully_shard(model, dp_mesh, config or FSDPConfig(), device, list(blocks or []), param_dtype=param_dtype)


def apply_ddp(model: nn.Module, dp_mesh: Any, device: torch.device) -> nn.Module:
    """Replicate over ``dp_mesh`` with FSDP2's ``replicate``: torch's DDP takes no DTensor
    parameters (TP's); parameters stay whole on every data-parallel rank, as under DDP."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    model = model.to(device)
    replicate(model, mesh=dp_mesh)
    return model


def apply_dp(model: nn.Module, strategy: Wrapping, place: Placement, blocks: Sequence[nn.Module],
             param_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard`` over ``dp_shard`` (HSDP when the shards are replicated too or the strategy
    is ``hybrid``); else the strategy's own replicate. Collective: call on every rank."""
    world = place.world
    if shards(strategy, place):
        hybrid = strategy.hybrid or place.dims.dp_replicate > 1
        dp_mesh = place["dp_replicate", "dp_shard"] if hybrid else place["dp_shard"]
        place.param_dtype = param_dtype
        return apply_fsdp(model, dp_mesh, world.device, blocks, strategy.fsdp, strategy.name, param_dtype)
    return strategy.replicate(model, world, place)


def shards(strategy: Wrapping, place: Placement) -> bool:
    """Whether the data-parallel wrap is ``fully_shard`` (``apply_dp``'s choice)."""
    return (place.dims.dp_shard > 1 or strategy.fsdp is not None) and place.world.distributed


class Wrapping(Protocol):
    """What ``parallelize`` asks of a strategy (``dtrain.strategies.base.Strategy`` declares it)."""

    name: str
    pipeline: PipelineConfig | None
    fsdp: FSDPConfig | None
    hybrid: bool
    tp_plan: Callable[[nn.Module, int], dict[str, Any]] | None
    placement: Placement | None

    @property
    def capabilities(self) -> Any: ...

    def layout(self, world: Any) -> ParallelDims: ...

    def replicate(self, model: nn.Module, world: Any, place: Placement) -> nn.Module: ...

    def placed(self, place: Placement) -> None: ...


def parallelize(model: nn.Module, strategy: Wrapping, world: Any, *, blocks: Sequence[nn.Module] = (),
                activation_checkpointing: bool = False, compile: bool = False, precision: Precision | None = None) -> nn.Module:
    """The one order every strategy and layout goes through (the module docstring); the strategy
    keeps the placement. Collective: call on every rank."""
    dims = strategy.layout(world)
    place = strategy.placement.again(dims, world) if strategy.placement is not None else Placement(dims, world)
    blocks = list(blocks)
    if place.dims.pp > 1 or strategy.pipeline is not None:  # first: every later step applies to this stage only
        model, blocks = apply_pp(model, place, strategy.pipeline or PipelineConfig(), blocks)
    before = dict(model.named_parameters())
    float8 = precision.float8 if precision is not None else None
    if float8 is not None:
        sharded = shards(strategy, place)
        place.float8_linears = apply_float8(model, float8, blocks, sharded=sharded)
        place.float8_all_gather = sharded and float8.recipe == "tensorwise" and place.float8_linears > 0
    if place.dims.tp > 1:
        model = apply_layout_tp(model, place.dims, place, world.device, strategy.tp_plan)
        place.scores = place.dims.coordinates(world.rank)["tp"] == 0
    if activation_checkpointing:
        apply_ac(blocks)
    per_block = bool(compile and blocks and transforms.compile_per_block(strategy.capabilities, activation_checkpointing))
    if per_block:
        apply_compile(blocks)
    model = apply_dp(model, strategy, place, blocks, precision.autocast_dtype if precision is not None else None)
    place.note_replaced(before, model)
    if compile and not per_block:
        model.compile()
    strategy.placed(place)
    return model


def apply_layout_tp(model: nn.Module, dims: ParallelDims, mesh: Any, device: torch.device,
                    plan: Callable[[nn.Module, int], dict[str, Any]] | None) -> nn.Module:
    """TP of ``dims`` (none when ``tp`` is 1), with the task's plan for this model; ``mesh`` is
    only indexed once the plan is known (a missing plan is one line, before any collective)."""
    if dims.tp > 1:
        if plan is None:
            raise ConfigError(f"--parallel {dims}: the task has no tensor-parallel plan; set Task.tp_plan "
                              "(e.g. the lm task's gpt_tp_plan), or drop tp.")
        apply_tp(model.to(device), mesh["tp"], plan(model, dims.tp))
    return model
