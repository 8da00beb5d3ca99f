"""Each parallelism as one short function, applied by ``parallelize`` in one fixed order for
every strategy:

1. ``apply_pp``: pipeline split (``pp``): this rank keeps its stage's layers, and every later
   step applies to that stage alone,
2. ``apply_tp``: tensor parallelism (the task's plan, through ``parallelize_module``),
   (1 and 2 are the strategy's ``split``: the composed strategy's layout),
3. ``apply_ac``: activation checkpointing of each block,
4. ``apply_compile``: ``torch.compile`` of each block,
5. ``apply_fsdp`` (``dp_shard``, with ``dp_replicate``: HSDP) or ``apply_ddp`` (``dp_replicate``),
   or a named strategy's own wrap (DDP with ``--comm``, ``fully_shard``, ...): ``setup_model``,
6. ``torch.compile`` of the whole wrapped model when no blocks were given.

The order is torchtitan's (its pipeline split, then ``parallelize_llama``): the pipeline cut
first, so each stage is parallelised on its own; TP rewrites the layers' parameters into
DTensors, so checkpointing recomputes and compile traces the split layers, and FSDP, last,
shards what TP left on each rank over the data-parallel ranks (a 2-D DTensor). A sharded or
replicated stage works inside a pipeline schedule because torch's ``PipelineStage`` drives
FSDP2's (and ``replicate``'s) gradient sync itself: held back on every micro-batch's backward,
reduced once after the last (``torch/distributed/pipelining/stage.py``,
``backward_maybe_with_nosync`` and ``perform_reduce_grad``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import ConfigError
from . import transforms
from .dims import ParallelDims
from .fsdp import FSDPConfig, apply_fully_shard
from .pipeline import PipelineConfig, split_stage
from .stages import Stages


def apply_pp(model: nn.Module, pp_mesh: Any, config: PipelineConfig, blocks: Sequence[nn.Module] | None
             ) -> tuple[nn.Module, list[nn.Module], Stages]:
    """Cut ``model`` (an ``nn.Sequential``) into ``pp`` stages between its blocks; returns this
    rank's stage (original layer names kept), the blocks in it, and its place in the pipeline."""
    stages = Stages.of_mesh(pp_mesh)
    stage = split_stage(model, stages.index, stages.count, config, list(blocks or []) or None)
    inside = {id(m) for m in stage.modules()}
    return stage, [b for b in blocks or [] if id(b) in inside], stages


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
    ties = _ties(model)
    model = parallelize_module(model, tp_mesh, plan)
    _retie(model, ties)
    return model


def _ties(model: nn.Module) -> list[list[str]]:
    """Names of the parameters that are one tensor (weight tying), grouped."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    """``parallelize_module`` gives each layer its own new parameter, which would train a tied
    pair as two tensors: point every name of a tie at the first one's again, if the plan split
    them alike (an embedding split by rows and a head by columns hold the same rows)."""
    for names in ties:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            other = model.get_parameter(name)
            if other is first:
                continue
            if _layout(other) != _layout(first):
                raise ConfigError(f"the tensor-parallel plan splits the tied parameters {names[0]} ({_layout(first)}) and {name} "
                                  f"({_layout(other)}) differently; split both alike (vocabulary rows: RowwiseParallel embedding, "
                                  "ColwiseParallel head) or untie them (task lm: --task-arg tie=false).")
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)


def _layout(p: torch.Tensor) -> str:
    placements = getattr(p, "placements", None)
    return "whole" if placements is None else ",".join(map(str, placements))


def apply_ac(blocks: Sequence[nn.Module]) -> int:
    """Recompute each block's activations in backward (``dtrain.parallel.transforms``)."""
    return transforms.apply_activation_checkpointing(blocks)


def apply_compile(blocks: Sequence[nn.Module]) -> None:
    """``torch.compile`` each block in place (``dtrain.parallel.transforms``)."""
    transforms.compile_blocks(blocks)


def apply_fsdp(model: nn.Module, dp_mesh: Any, device: torch.device, blocks: Sequence[nn.Module] | None,
               config: FSDPConfig | None = None) -> nn.Module:
    """``fully_shard`` each block, then the root, over ``dp_mesh`` (1-D: FSDP; 2-D
    (dp_replicate, dp_shard): HSDP); the fsdp strategy's own function."""
    return apply_fully_shard(model, dp_mesh, config or FSDPConfig(), device, list(blocks or []))


def apply_ddp(model: nn.Module, dp_mesh: Any, device: torch.device) -> nn.Module:
    """Replicate over ``dp_mesh``: gradients all-reduced in backward. torch's
    ``DistributedDataParallel`` takes no DTensor parameters, so with TP this is FSDP2's
    ``replicate`` (DDP built on fully_shard's machinery), which composes with TP's DTensors;
    parameters then stay whole on every data-parallel rank, as under DDP."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    model = model.to(device)
    replicate(model, mesh=dp_mesh)
    return model


class Wrapping(Protocol):
    """What ``parallelize`` asks of a strategy (``dtrain.strategies.base.Strategy`` declares both)."""

    def split(self, model: nn.Module, world: Any, blocks: list[nn.Module]) -> tuple[nn.Module, list[nn.Module]]: ...

    def setup_model(self, model: nn.Module, world: Any, blocks: list[nn.Module] | None = None) -> nn.Module: ...

    @property
    def capabilities(self) -> Any: ...


def parallelize(model: nn.Module, strategy: Wrapping, world: Any, *, blocks: Sequence[nn.Module] = (),
                activation_checkpointing: bool = False, compile: bool = False) -> nn.Module:
    """The one order every strategy goes through: its cuts (pipeline stage, TP), activation
    checkpointing and compile of each block where compile goes per block
    (``transforms.compile_per_block``: sharded parameters, pipeline stages, activation
    checkpointing), its data-parallel wrap, then compile of the whole wrapped model otherwise (as
    torch's documentation does for DDP: the compiled DDP module splits its graph at bucket
    boundaries, DDPOptimizer). Collective: call on every rank."""
    model, blocks = strategy.split(model, world, list(blocks))
    if activation_checkpointing:
        apply_ac(blocks)
    per_block = bool(compile and blocks and transforms.compile_per_block(strategy.capabilities, activation_checkpointing))
    if per_block:
        apply_compile(blocks)
    inner = strategy.setup_model(model, world, blocks=blocks or None)
    if compile and not per_block:
        inner.compile()
    return inner


def compose(model: nn.Module, dims: ParallelDims, mesh: Any, device: torch.device, *,
            blocks: Sequence[nn.Module] | None = None, fsdp: FSDPConfig | None = None) -> nn.Module:
    """The data-parallel step of ``dims`` (after ``apply_pp``, ``apply_tp`` and ``parallelize``'s
    per-block steps): FSDP over ``dp_shard`` (HSDP with ``dp_replicate``), else DDP over
    ``dp_replicate``, else the model on the device. Collective: call on every rank."""
    if dims.dp_shard > 1:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
        return apply_fsdp(model, dp_mesh, device, blocks, fsdp)
    if dims.dp_replicate > 1:
        return apply_ddp(model, mesh["dp_replicate"], device)
    return model.to(device)


def apply_layout_tp(model: nn.Module, dims: ParallelDims, mesh: Any, device: torch.device,
                    plan: Callable[[nn.Module, int], dict[str, Any]] | None) -> nn.Module:
    """TP of ``dims`` (none when ``tp`` is 1), with the task's plan for this model."""
    if dims.tp > 1:
        if plan is None:
            raise ConfigError(f"--parallel {dims}: the task has no tensor-parallel plan; set Task.tp_plan "
                              "(e.g. the lm task's gpt_tp_plan), or drop tp.")
        apply_tp(model.to(device), mesh["tp"], plan(model, dims.tp))
    return model
