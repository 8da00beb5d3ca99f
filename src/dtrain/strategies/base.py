"""What every strategy provides, and the steps strategies share (plain functions, not a base class)."""

from __future__ import annotations

import contextlib
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..world import World


@runtime_checkable
class Strategy(Protocol):
    """How a model and its optimizer are spread over ranks.

    Optional hooks, looked up with ``getattr`` by the context and the checkpoint manager:
    ``state_dict``/``load_state_dict`` (per-rank communication state), ``forward_backward``
    (pipeline: the step runs through the stages), ``forward_only`` (pipeline evaluation),
    ``data_parallel(world) -> (rank, size)`` (how the data is sharded; pipeline: one replica),
    ``clip_grad_norm_`` (a norm over every rank's gradients), ``collective_forward`` (fsdp:
    every forward communicates, so evaluation keeps ranks in step), ``sharded_checkpoint``
    (every rank saves its part through torch.distributed.checkpoint), ``prepare_checkpoint``
    (zero1: gather state on rank 0 first), ``comm_payload_bytes`` (for ``dtrain bench``).
    """

    name: str

    def setup_model(self, model: nn.Module, world: World) -> nn.Module:
        """Move ``model`` to the world's device and wrap it for this strategy."""
        ...

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """Wrap ``optimizer`` if the strategy communicates through it (identity otherwise)."""
        ...

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context in which backward passes accumulate gradients locally without communicating."""
        ...

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever wrapper ``setup_model`` added."""
        ...


class ForwardingOptimizer(torch.optim.Optimizer):
    """An optimizer that wraps another and forwards its state (``isinstance`` checks and LR
    schedulers keep working). Subclasses override ``step`` and ``zero_grad``."""

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


def move_to_device(model: nn.Module, world: World) -> nn.Module:
    return model.to(world.device)


def unwrap_module(model: nn.Module) -> nn.Module:
    """Peel wrappers that keep the user's module in ``.module`` (DDP, DataParallel)."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model
