"""What every strategy provides (``Strategy``, ``Capabilities``), and the steps strategies share."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..parallel.apply import parallelize
from ..parallel.dims import ParallelDims
from ..parallel.fsdp import FSDPConfig
from ..parallel.pipeline import PipelineConfig
from ..parallel.placement import Placement
from ..precision import Precision
from ..world import World

if TYPE_CHECKING:
    from ..comm.collectives import Collectives


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """The yes/no questions callers ask of a strategy (``strategy.capabilities.X``), declared by
    each strategy instead of probed with ``getattr``."""

    collective_forward: bool = False
    """Every forward communicates (fsdp, hsdp: parameters are all-gathered), so ranks must run
    the same number of forwards: ``ctx.evaluate`` pads the ranks with fewer batches."""
    sharded_params: bool = False
    """Parameters become shards (DTensors) of the whole; torch shards only contiguous ones, so
    channels-last (NHWC) weights cannot be used."""
    sharded_state: bool = False
    """Checkpoints are written by every rank through torch.distributed.checkpoint (fsdp, hsdp,
    pipeline) instead of one file from rank 0."""
    staged_step: bool = False
    """With several processes the training step must go through ``forward_backward`` (pipeline:
    micro-batches flow through the stages); a plain ``model(x)`` runs only this rank's part."""
    supports_comm: bool = False
    """``--comm`` methods (compression, PowerSGD, local SGD) can replace the gradient all-reduce."""


class Strategy(abc.ABC):
    """How a model and its optimizer are spread over ranks: the contract every strategy meets. A
    strategy declares ``name``, ``capabilities`` and ``layout`` (a ``ParallelDims`` preset) and
    supplies its pieces of the one apply path; every other hook defaults to a strategy without
    that feature."""

    name: str = ""
    """Declared on the class (a layout's strategy is named by its instance: ``fsdp``, ``composed``, ...)."""
    capabilities: Capabilities = Capabilities()
    """Declared on the class, or in ``__init__`` where the answers depend on how it was built."""
    pipeline: PipelineConfig | None = None
    """Cut the model into the layout's pipeline stages with these settings (None: no stages)."""
    fsdp: FSDPConfig | None = None
    """How to shard the model over the layout's ``dp_shard`` ranks (None: FSDPConfig's defaults
    where ``dp_shard`` > 1)."""
    hybrid: bool = False
    """Shard within groups and replicate across them (HSDP), even where the layout has one group."""
    tp_plan: Callable[[nn.Module, int], dict] | None = None
    """The tensor-parallel plan, ``(model, tp) -> {submodule name: ParallelStyle}``, for ``tp`` > 1."""
    placement: Placement | None = None
    """Where this rank sits in the layout, once ``setup_model`` has run (``placed``)."""

    # -- the layout and the apply path -------------------------------------------------------------
    def layout(self, world: World) -> ParallelDims:
        """How this strategy splits ``world``'s ranks (its preset); by default every rank is a replica."""
        return ParallelDims(dp_replicate=world.size)

    def setup_model(self, model: nn.Module, world: World, blocks: list[nn.Module] | None = None) -> nn.Module:
        """``model`` parallelised for this layout through the one apply path (``blocks``: fsdp
        units, pipeline cut points). Collective: call on every rank."""
        return parallelize(model, self, world, blocks=blocks or ())

    def replicate(self, model: nn.Module, world: World, place: Placement) -> nn.Module:
        """This strategy's way of replicating ``model`` over ``dp_replicate`` where it does not shard
        (default: the model on the device). Collective where it communicates."""
        return model.to(world.device)

    def placed(self, place: Placement) -> None:
        """Keep where this rank sits in the layout (called by the apply path after the wrap)."""
        self.placement = place

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        """Wrap or re-point ``optimizer`` if the strategy communicates through it or replaced the
        parameters it was built on (identity by default)."""
        return optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside the wrappers that keep it in ``.module`` (DDP, DataParallel)."""
        while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        return model

    def data_parallel(self, world: World) -> tuple[int, int]:
        """(rank, size) for sharding the data: ranks that differ only in TP rank or stage read the same."""
        dims = self.layout(world)
        return dims.dp_rank(world.rank), dims.dp

    # -- the step --------------------------------------------------------------------------------
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context in which backward passes accumulate gradients locally without communicating."""
        return contextlib.nullcontext()

    def forward_backward(self, model: nn.Module, inputs: torch.Tensor, target: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                         accumulation_steps: int, precision: Precision, collectives: Collectives) -> torch.Tensor:
        """The whole step of a ``staged_step`` strategy; the mean loss on every rank.
        Collective: call on every rank with the same batch."""
        raise NotImplementedError(f"strategy {self.name!r} has no staged step (capabilities.staged_step is False)")

    def forward_only(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
        """The model's output for evaluation; None on ranks whose output is not scored (earlier
        pipeline stages, TP peers). Collective for staged and composed strategies: call on every rank."""
        return model(inputs)

    def clip_grad_norm_(self, parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over every rank's gradients; returns the norm before clipping.
        Collective under sharded and staged strategies: call on every rank."""
        norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
        # Sharded gradients (fsdp: DTensors) give a DTensor norm, already over all shards.
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After each real optimizer step (local SGD averages here); collective where it does anything."""

    # -- checkpoints and records -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any] | None:
        """This rank's own communication state for checkpoints (None: it has none)."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned on this rank."""

    def prepare_checkpoint(self, objects: dict[str, Any]) -> None:
        """Before a checkpoint's state dicts are taken (zero1 gathers on rank 0); called on every rank."""

    def comm_record(self) -> dict[str, Any]:
        """Fields for result records about how gradients travelled (ddp: ``comm``, ``comm_choice``)."""
        return {}

    def comm_payload_bytes(self, model: nn.Module) -> int | None:
        """Bytes handed to collectives per step (default: one all-reduce of the trainable gradients;
        None: unknown)."""
        return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class ForwardingOptimizer(torch.optim.Optimizer):
    """An optimizer that wraps another and forwards its state (``isinstance`` checks and LR
    schedulers keep working); ``zero_grad`` forwards, as torch's own would patch the wrapper's class."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # Deliberately no super().__init__: the wrapped optimizer owns the state.
        self.optimizer = optimizer

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    @property
    def param_groups(self):  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def defaults(self):  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
