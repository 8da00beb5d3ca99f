"""Pipeline model parallelism with ``torch.distributed.pipelining``: an ``nn.Sequential`` cut
into one stage per rank; each batch is split into micro-batches that flow through the stages
(GPipe, Huang et al. 2019; or 1F1B, Narayanan et al., "PipeDream", 2019).

Every rank holds only its stage's layers, their gradients and their optimizer state. There is
no data parallelism: all ranks see the same batch (the first stage reads its inputs, the last
its targets), so ``ctx.setup_dataloader`` does not shard the data under this strategy.

The training step goes through ``ctx.forward_backward(model, inputs, target, loss_fn)``: a
plain ``model(x)`` would run this rank's stage alone. The loss lives on the last stage and is
broadcast, so every rank returns the same value.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .._log import note_once
from ..errors import ConfigError
from ..precision import Precision
from ..world import World
from . import register
from .base import Capabilities, Strategy
from .stages import Pipe, Stages

if TYPE_CHECKING:
    from ..collectives import Collectives

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    schedule: str = "1f1b"
    """``gpipe`` (all forwards, then all backwards: activations of every micro-batch held) or
    ``1f1b`` (one forward, one backward in turn: at most #stages micro-batches in flight)."""
    microbatches: int = 4
    """Micro-batches per batch; the batch size must be a multiple. More: a smaller bubble."""
    split_points: tuple[str, ...] | None = None
    """Names of the ``nn.Sequential`` children that begin stages 1, 2, ... (e.g. ``("3",)``);
    default: the model's blocks (given to ``ctx.setup``) split evenly over the stages, the
    layers before the first block in the first stage and those after the last in the last;
    without blocks, stages balanced by parameter count."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {self.schedule!r}; choose one of: {', '.join(SCHEDULES)}.")
        if self.microbatches < 1:
            raise ConfigError(f"microbatches must be >= 1, got {self.microbatches}.")
        if isinstance(self.split_points, str):
            object.__setattr__(self, "split_points", tuple(s.strip() for s in self.split_points.split(",") if s.strip()))


def stage_bounds(model: nn.Sequential, stages: int, split_points: tuple[str, ...] | None) -> list[tuple[int, int]]:
    """[start, end) child indices of each stage."""
    names = [name for name, _ in model.named_children()]
    if len(names) < stages:
        raise ConfigError(f"pipeline: the model has {len(names)} layer(s), fewer than the {stages} stages (one per process); use fewer processes.")
    if split_points is not None:
        if len(split_points) != stages - 1:
            raise ConfigError(f"pipeline: {len(split_points)} split point(s) give {len(split_points) + 1} stages, but there are {stages} processes; give {stages - 1}.")
        unknown = [s for s in split_points if s not in names]
        if unknown:
            raise ConfigError(f"pipeline: split point(s) {', '.join(unknown)} are not layers of the model; its layers are: {', '.join(names)}.")
        starts = [names.index(s) for s in split_points]
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ConfigError(f"pipeline: split points {', '.join(split_points)} must be increasing and after the first layer.")
        edges = [0, *starts, len(names)]
        return list(zip(edges[:-1], edges[1:]))
    sizes = [sum(p.numel() for p in child.parameters()) for child in model.children()]
    total, bounds, start, acc = max(1, sum(sizes)), [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        left_layers, left_stages = len(sizes) - i - 1, stages - len(bounds) - 1
        if left_stages and (acc >= total * (len(bounds) + 1) / stages or left_layers == left_stages):
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, len(sizes)))
    return bounds


def block_bounds(model: nn.Sequential, stages: int, blocks: list[nn.Module]) -> list[tuple[int, int]] | None:
    """[start, end) child indices of each stage, cut only between blocks, with the blocks split
    evenly (as torchtitan splits a transformer's layers); None when the blocks are not children
    of ``model`` (then the parameter-balanced default applies)."""
    children = list(model.children())
    index = {id(c): i for i, c in enumerate(children)}
    at = sorted(index[id(b)] for b in blocks if id(b) in index)
    if len(at) != len(blocks) or not at:
        return None
    if len(at) < stages:
        raise ConfigError(f"pipeline: the model has {len(at)} block(s), fewer than the {stages} stages (one per process); "
                          "use fewer processes or a deeper model.")
    starts = [at[len(at) * s // stages] for s in range(1, stages)]
    edges = [0, *starts, len(children)]
    return list(zip(edges[:-1], edges[1:]))


def build_stage(model: nn.Module, world: World, config: PipelineConfig, blocks: list[nn.Module] | None = None) -> nn.Sequential:
    """This rank's stage of one pipeline over the whole world, on the world's device."""
    return split_stage(model, world.rank, world.size, config, blocks).to(world.device)


def split_stage(model: nn.Module, index: int, count: int, config: PipelineConfig,
                blocks: list[nn.Module] | None = None) -> nn.Sequential:
    """Stage ``index`` of ``count``: the children of its range, under their original names (so
    state dict keys match the whole model's and checkpoints load on any layout)."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"pipeline: the model is a {type(model).__name__}, not an nn.Sequential; "
            "write it as nn.Sequential(layer, ...) so it can be cut into stages."
        )
    bounds = block_bounds(model, count, blocks) if blocks and config.split_points is None else None
    bounds = bounds or stage_bounds(model, count, config.split_points)
    start, end = bounds[index]
    children = list(model.named_children())
    _check_untied(children, bounds)
    return nn.Sequential(OrderedDict(children[start:end]))


def keep_params(optimizer: torch.optim.Optimizer, mine: set[int], name: str) -> torch.optim.Optimizer:
    """Drop from ``optimizer`` (built on the whole model) the parameters of other stages."""
    if any(optimizer.state.values()):
        raise ConfigError(f"{name}: the {type(optimizer).__name__} already holds state; build it fresh, call ctx.setup, then load a checkpoint.")
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in mine]
    return optimizer


def _check_untied(children: list[tuple[str, nn.Module]], bounds: list[tuple[int, int]]) -> None:
    """A parameter shared by layers of two stages (tied weights) would become two copies
    trained apart; refuse it rather than train something else than the model."""
    owner: dict[int, tuple[int, str]] = {}
    for stage, (start, end) in enumerate(bounds):
        for name, child in children[start:end]:
            for pname, p in child.named_parameters():
                seen = owner.setdefault(id(p), (stage, f"{name}.{pname}"))
                if seen[0] != stage:
                    raise ConfigError(
                        f"pipeline: parameter {seen[1]} (stage {seen[0]}) is shared with {name}.{pname} (stage {stage}); "
                        "tied weights cannot span stages: untie them (task lm: --task-arg tie=false)."
                    )


@register("pipeline")
class PipelineStrategy(Strategy):
    name = "pipeline"
    # Each rank saves its own stage through torch.distributed.checkpoint; the step runs through
    # the stages. ``blocks`` (setup_model): the stages are cut between them when no split points are given.
    capabilities = Capabilities(sharded_state=True, staged_step=True)

    def __init__(self, config: PipelineConfig | None = None, **options: Any) -> None:
        self.config = config or PipelineConfig(**options)
        self._world: World | None = None
        self._stage_module: nn.Module | None = None
        self._pipe: Pipe | None = None

    # -- the strategy protocol ---------------------------------------------------------------
    def setup_model(self, model: nn.Module, world: World, blocks: list[nn.Module] | None = None) -> nn.Module:
        self._world = world
        if not world.distributed:
            note_once("pipeline with one process: one stage, the whole model; no micro-batch schedule.")
        self._stage_module = build_stage(model, world, self.config, blocks)
        self._pipe = Pipe(Stages.of_world(world), self.config, world.device)
        return self._stage_module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        # The optimizer was built on the whole model; keep only this stage's parameters, so the
        # other stages' layers (and their optimizer state) are not held on this rank.
        mine = {id(p) for p in self._stage_module.parameters()} if self._stage_module is not None else set()
        return keep_params(optimizer, mine, "pipeline")

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # no data parallelism: gradients are never all-reduced

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def comm_payload_bytes(self, model: nn.Module) -> None:
        """Activations and their gradients between stages: not counted (unknown)."""
        return None

    def data_parallel(self, world: World) -> tuple[int, int]:
        """(rank, size) for sharding data: one replica, so every rank reads the same batches."""
        return 0, 1

    # -- the step ------------------------------------------------------------------------------
    def forward_backward(self, model: nn.Module, inputs: torch.Tensor, target: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                         accumulation_steps: int, precision: Precision, collectives: Collectives) -> torch.Tensor:
        """Forward and backward of one (micro-)batch through every stage; the mean loss, on every rank.

        Collective: call on every rank with the same batch."""
        return self._pipe.forward_backward(model, inputs, target, loss_fn, accumulation_steps=accumulation_steps,
                                           precision=precision, collectives=collectives)

    def forward_only(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
        """The whole model's output on the last stage (None on the others). Collective: call on
        every rank with the same batch."""
        return self._pipe.forward_only(model, inputs)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over every stage's gradients. Collective: call on every rank."""
        params = [p for p in parameters if p.grad is not None]
        local = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        if self._world is not None and self._world.distributed:
            if norm_type == float("inf"):
                dist.all_reduce(local, op=dist.ReduceOp.MAX)
                total = local
            else:
                powered = local.double() ** norm_type
                dist.all_reduce(powered, op=dist.ReduceOp.SUM)
                total = (powered ** (1.0 / norm_type)).to(local.dtype)
        else:
            total = local
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

