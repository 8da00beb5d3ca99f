"""Several parallelisms at once, from one ``ParallelDims`` (``dtrain.init(parallel=...)``,
``--parallel dp_shard=2,tp=2``): the mesh is built once; ``split`` cuts this rank's pipeline
stage (``pp``, ``dtrain.parallel.apply.apply_pp``) and applies tensor parallelism to it, then
``dtrain.parallel.apply.parallelize`` checkpoints and compiles its blocks, and ``setup_model``
applies FSDP/DDP (``compose``), in that order. With ``pp`` the step runs through a pipeline
schedule over the ranks along the mesh's ``pp`` dimension (``dtrain.parallel.stages``), one
pipeline per data-parallel rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ConfigError
from ..parallel import apply as par
from ..parallel.clip import clip_grad_norm_
from ..parallel.dims import ParallelDims, resolve
from ..parallel.fsdp import FSDPConfig
from ..parallel.pipeline import PipelineConfig, keep_params
from ..parallel.stages import Pipe
from ..precision import Precision
from ..world import World
from . import register
from .base import Capabilities, Strategy

if TYPE_CHECKING:
    from ..comm.collectives import Collectives


@register("composed")
class ComposedStrategy(Strategy):
    name = "composed"
    # TP's layers all-reduce in forward and FSDP all-gathers (every rank runs every forward);
    # parameters are DTensors; every rank saves its pieces through torch.distributed.checkpoint.
    # With pp the instance also declares staged_step (its step goes through the stages).
    capabilities = Capabilities(collective_forward=True, sharded_params=True, sharded_state=True)

    def __init__(self, parallel: str | dict | ParallelDims = "dp_replicate=1", *, tp_plan: Callable[[nn.Module, int], dict] | None = None,
                 fsdp: FSDPConfig | None = None, pipeline: PipelineConfig | None = None) -> None:
        self.dims = resolve(parallel)
        if tp_plan is not None and not callable(tp_plan):
            raise ConfigError(f"tp_plan is a {type(tp_plan).__name__}; give a function (model, tp) -> {{name: ParallelStyle}}.")
        self.tp_plan = tp_plan
        self.fsdp, self.pipeline = fsdp, pipeline or PipelineConfig()
        if self.dims.pp > 1:
            self.capabilities = Capabilities(collective_forward=True, sharded_params=True, sharded_state=True, staged_step=True)
        self.mesh: Any = None
        self._pipe: Pipe | None = None
        self._stage_params: set[int] | None = None
        self._before: dict[str, nn.Parameter] = {}
        self._replaced: dict[int, nn.Parameter] = {}
        self._scores = True

    def __repr__(self) -> str:
        return f"ComposedStrategy({self.dims})"

    def split(self, model: nn.Module, world: World, blocks: list[nn.Module]) -> tuple[nn.Module, list[nn.Module]]:
        """This rank's pipeline stage (pp), its layers split by TP: the steps before activation
        checkpointing and compile. Collective: call on every rank."""
        self.dims.check_world(world.size)
        if self.mesh is None:
            self.mesh = self.dims.build_mesh(world.device.type)
        # Ranks of one TP group compute the same outputs: only the first scores them in evaluation.
        self._scores = self.dims.coordinates(world.rank)["tp"] == 0
        if self.dims.pp > 1:  # first: every later step applies to this rank's stage only
            model, blocks, stages = par.apply_pp(model, self.mesh["pp"], self.pipeline, blocks)
            self._pipe = Pipe(stages, self.pipeline, world.device)
            self._stage_params = {id(p) for p in model.parameters()}
        self._before = dict(model.named_parameters())
        return par.apply_layout_tp(model, self.dims, self.mesh, world.device, self.tp_plan), blocks

    def setup_model(self, model: nn.Module, world: World, blocks: list[nn.Module] | None = None) -> nn.Module:
        """FSDP/DDP over the layout's data-parallel ranks (after ``split``). Collective: call on every rank."""
        if self.mesh is None:  # called without parallelize: the cuts first
            model, blocks = self.split(model, world, list(blocks or []))
        model = par.compose(model, self.dims, self.mesh, world.device, blocks=blocks, fsdp=self.fsdp)
        after = dict(model.named_parameters())
        self._replaced.update({id(p): after[n] for n, p in self._before.items() if n in after})
        return model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """Keep this rank's stage's parameters (pp), and point the optimizer at the DTensor
        parameters TP and FSDP put in place of the ones it was built on (as fsdp does)."""
        if self._stage_params is not None:
            optimizer = keep_params(optimizer, self._stage_params, "composed")
        if any(optimizer.state.values()):
            raise ConfigError(f"composed: the {type(optimizer).__name__} already holds state; build it fresh, call ctx.setup, then load a checkpoint.")
        for group in optimizer.param_groups:
            group["params"] = [self._replaced.get(id(p), p) for p in group["params"]]
        return optimizer

    def data_parallel(self, world: World) -> tuple[int, int]:
        """Ranks of one TP group (and of one pipeline) read the same batch."""
        return self.dims.dp_rank(world.rank), self.dims.dp

    def forward_backward(self, model: nn.Module, inputs: torch.Tensor, target: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                         accumulation_steps: int, precision: Precision, collectives: Collectives) -> torch.Tensor:
        """With pp: the step through this rank's pipeline (its data-parallel rank's batch); the
        mean loss on every rank of the pipeline. Collective: call on every rank."""
        if self._pipe is None:
            return super().forward_backward(model, inputs, target, loss_fn, accumulation_steps=accumulation_steps,
                                            precision=precision, collectives=collectives)
        return self._pipe.forward_backward(model, inputs, target, loss_fn, accumulation_steps=accumulation_steps,
                                           precision=precision, collectives=collectives)

    def forward_only(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
        """The output where this rank scores it: the last stage (pp), the first rank of each TP
        group (its peers compute the same outputs, which would count every sample tp times).
        Collective: call on every rank."""
        out = self._pipe.forward_only(model, inputs) if self._pipe is not None else model(inputs)
        return out if self._scores else None

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The norm over every dimension's pieces, every stage's (one all-reduce). Collective."""
        return clip_grad_norm_(list(parameters), max_norm, norm_type, stages=self.dims.pp)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if self._pipe is not None:
            # torch's PipelineStage turns FSDP's/replicate's gradient sync off and on itself.
            return contextlib.nullcontext()
        return _no_sync(model)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # every step changes the module in place

    def comm_payload_bytes(self, model: nn.Module) -> None:
        """Unknown (``dtrain bench`` shows '-'): TP's all-reduces carry activations, whose size
        depends on the batch, beside FSDP's or DDP's gradient traffic."""
        return None


@contextlib.contextmanager
def _no_sync(model: nn.Module) -> Iterator[None]:
    setter = getattr(model, "set_requires_gradient_sync", None)  # fully_shard / replicate
    if setter is None:
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)


def strategy_for(strategy: Any, parallel: Any, world_size: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The strategy (name, options) that runs the layout ``parallel``. A layout of one kind is
    today's strategy (``dp_replicate=N``: ddp, ``dp_shard=N``: fsdp, both: hsdp, ``pp=N``:
    pipeline), so it runs exactly as before; a layout with tp is the composed strategy."""
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
    # The pipeline's options (schedule, microbatches, split_points) go to the pp cut, fsdp's
    # (wrap, ...) to the dp_shard step.
    piped = {k: options.pop(k) for k in _PIPELINE_OPTIONS if k in options}
    try:
        fsdp = FSDPConfig(**options) if options else None
    except TypeError:
        raise ConfigError(f"parallel={dims} takes the fsdp options (wrap, offload, reshard_after_forward), the pipeline's "
                          f"(schedule, microbatches, split_points) and tp_plan; drop {', '.join(sorted(options))}.") from None
    return "composed", {"parallel": dims, "tp_plan": plan, "fsdp": fsdp, "pipeline": PipelineConfig(**piped) if piped else None}


_PIPELINE_OPTIONS = ("schedule", "microbatches", "split_points")
