"""A layout run with each dimension's usual way: the strategy behind ``ddp``, ``fsdp``, ``hsdp``,
``pipeline`` and every ``--parallel`` layout. What the apply path leaves is here: replication, the
staged step and evaluation, clipping over every piece.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._log import note_once
from ..parallel.apply import apply_ddp
from ..parallel.clip import clip_grad_norm_, clip_stages_
from ..parallel.dims import ParallelDims
from ..parallel.fsdp import REDUCE_DTYPES, FSDPConfig
from ..parallel.pipeline import PipelineConfig
from ..parallel.placement import Placement
from ..precision import Precision
from ..world import World
from .base import Capabilities, Strategy

if TYPE_CHECKING:
    from ..comm.collectives import Collectives

REPLICAS = Capabilities(supports_comm=True)
"""DDP's replicas: ``--comm`` methods replace its gradient all-reduce."""
SHARDS = Capabilities(collective_forward=True, sharded_params=True, sharded_state=True)
"""``fully_shard``: every forward all-gathers; parameters are DTensor shards; checkpoints go
through torch.distributed.checkpoint."""
STAGES = Capabilities(sharded_state=True, staged_step=True)
"""Pipeline stages: each rank saves its own stage; the step runs through the stages."""
SPLITS = Capabilities(collective_forward=True, sharded_params=True, sharded_state=True)
"""Tensor parallelism (its layers all-reduce in forward), and FSDP2's ``replicate`` of split or
staged layers: DTensor parameters, saved through torch.distributed.checkpoint."""


def combined(*declared: Capabilities) -> Capabilities:
    """What a layout of several ways declares: each answer yes where one way's is."""
    return Capabilities(**{f.name: any(getattr(c, f.name) for c in declared) for f in fields(Capabilities)})


class LayoutStrategy(Strategy):
    """The layout ``preset(world)`` with its ways: ``ddp`` (replicas by DDP, with ``--comm``),
    ``fsdp`` (shards, ``hybrid``: HSDP), ``pipeline`` (stages), ``tp_plan`` (TP)."""

    name = "composed"
    capabilities = SPLITS  # a composed layout's; each instance declares its own ways'

    def __init__(self, name: str, preset: Callable[[World], ParallelDims], *, capabilities: Capabilities,
                 ddp: Any = None, fsdp: FSDPConfig | None = None, hybrid: bool = False,
                 pipeline: PipelineConfig | None = None, tp_plan: Callable[[nn.Module, int], dict] | None = None,
                 alone: str | None = None) -> None:
        self.name, self.capabilities, self._preset = name, capabilities, preset
        self._ddp, self.fsdp, self.hybrid, self.pipeline, self.tp_plan = ddp, fsdp, hybrid, pipeline, tp_plan
        self._alone = alone
        """A note for one process, where the strategy's way has nothing to do."""

    def __repr__(self) -> str:
        return f"LayoutStrategy({self.name!r})"

    @property
    def config(self) -> Any:
        """The settings of its way: DDPConfig (replicas), FSDPConfig (shards) or PipelineConfig."""
        return self._ddp.config if self._ddp is not None else self.fsdp or self.pipeline

    def layout(self, world: World) -> ParallelDims:
        return self._preset(world)

    def replicate(self, model: nn.Module, world: World, place: Placement) -> nn.Module:
        """DDP over the replicas (with ``--comm``); FSDP2's ``replicate`` where TP or stages left
        DTensors or stages (DDP takes no DTensor parameters); one replica: the model on the device."""
        if self._ddp is not None:
            return self._ddp.wrap(model, world, place.group("dp_replicate"))
        if place.dims.dp_replicate > 1:
            return apply_ddp(model, place["dp_replicate"], world.device)
        if self._alone and not world.distributed:
            note_once(self._alone)
        return model.to(world.device)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        if self.placement is not None:
            optimizer = self.placement.fit_optimizer(optimizer, self.name)
        if self._ddp is not None:
            self._ddp.register_optimizer(optimizer)
        return optimizer

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if self._pipe() is not None:
            return contextlib.nullcontext()  # torch's PipelineStage turns the gradient sync off and on itself
        return no_sync(model)

    # -- the step and evaluation -------------------------------------------------------------------
    def _pipe(self) -> Any:
        return self.placement.pipe if self.placement is not None else None

    def forward_backward(self, model: nn.Module, inputs: torch.Tensor, target: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                         accumulation_steps: int, precision: Precision, collectives: Collectives) -> torch.Tensor:
        """The step through this rank's pipeline (its data-parallel rank's batch); the mean loss
        on every rank of the pipeline. Collective: call on every rank."""
        pipe = self._pipe() or super()
        return pipe.forward_backward(model, inputs, target, loss_fn, accumulation_steps=accumulation_steps,
                                     precision=precision, collectives=collectives)

    def forward_only(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
        """The output where this rank scores it: the last stage (pp), the first rank of each TP
        group. Collective: call on every rank."""
        pipe = self._pipe()
        out = pipe.forward_only(model, inputs) if pipe is not None else model(inputs)
        return out if self.placement is None or self.placement.scores else None

    def clip_grad_norm_(self, parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The norm over every rank's pieces (torch's where the parameters are plain or DTensors of
        one mesh). Collective: call on every rank."""
        place = self.placement
        dims = place.dims if place is not None else ParallelDims()
        if dims.tp > 1 or (dims.pp > 1 and dims.dp > 1):
            return clip_grad_norm_(list(parameters), max_norm, norm_type, stages=dims.pp)
        if place is not None and place.pipe is not None:
            return clip_stages_(parameters, max_norm, norm_type, distributed=place.world.distributed)
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    # -- communication state and records -----------------------------------------------------------
    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Collective: every rank, after each optimizer step (local SGD averages parameters here)."""
        if self._ddp is not None:
            self._ddp.after_step(optimizer)

    def comm_record(self) -> dict[str, Any]:
        return self._ddp.record() if self._ddp is not None else {}

    def state_dict(self) -> dict[str, Any] | None:
        return self._ddp.state_dict() if self._ddp is not None else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._ddp is not None:
            self._ddp.load_state_dict(state)

    def comm_payload_bytes(self, model: nn.Module) -> int | None:
        """Per step: None with TP or stages (activations depend on the batch); FSDP: the parameters
        all-gathered (twice when resharded after forward) and the gradients reduce-scattered."""
        dims = self.placement.dims if self.placement is not None else ParallelDims()
        if self.pipeline is not None or dims.tp > 1 or dims.pp > 1:
            return None
        if self.fsdp is not None and not self.hybrid and dims.dp_replicate == 1:
            params = [p for p in model.parameters() if p.requires_grad]  # DTensor: global size
            gathered = self.placement.param_dtype if self.placement is not None else None  # the policy's (None: as they are)
            gather = sum(p.numel() * (gathered.itemsize if gathered is not None else p.element_size()) for p in params)
            scatter = sum(p.numel() for p in params) * REDUCE_DTYPES[self.fsdp.reduce_dtype].itemsize
            return gather * (2 if self.fsdp.reshard_after_forward else 1) + scatter
        if self._ddp is not None:
            return self._ddp.payload_bytes(model)
        return super().comm_payload_bytes(model)


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """Backward passes that keep their gradients local, as the model's wrapper offers: DDP's
    ``no_sync``, FSDP2's gradient-sync switch (``fully_shard``, ``replicate``), or nothing."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        return _gradient_sync_off(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _gradient_sync_off(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # gradients accumulate unsharded, locally; reduced on the window's last step
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
