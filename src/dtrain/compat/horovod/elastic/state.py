"""``hvd.elastic.State``, ``ObjectState`` and ``TorchState`` with Horovod's contract (``commit()`` =
``save()`` + ``check_host_updates()``); each commit also goes to the node's ``CommitStore``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from dtrain import preempt

from .. import _basics
from .. import _ops as ops
from .._engine import HostsUpdatedInterrupt
from .._optimizer import broadcast_optimizer_state, broadcast_parameters
from .commits import CommitStore
from .sampler import ElasticSampler


class State:
    """State that is committed, restored and synchronised across workers (Horovod's base class)."""

    def __init__(self, bcast_object: Callable[..., Any] | None = None, get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object or ops.broadcast_object
        self._rank = get_rank or _basics.rank
        self._reset_callbacks: list[Callable[[], None]] = []
        self._commits: CommitStore | None = None
        self._number = 0

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Run ``callbacks`` after each reset (e.g. to scale the learning rate with the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (in memory, and on the node's disk for a restart), then check whether
        the workers are about to be restarted. Collective: call on every rank at the same step."""
        self.save()
        self._number += 1
        if self._commits is not None:
            self._commits.put(self._number, self.snapshot(), _basics.size())
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank once any rank's launcher asked its workers
        to stop (a node joins or leaves, or the job is stopped). Collective: call on every rank."""
        flag = torch.tensor([preempt.received()], dtype=torch.int32)
        if int(ops.allreduce(flag, op=ops.Max, name=None).item()):
            raise HostsUpdatedInterrupt(False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self, root_rank: int = 0) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a reset, before the callbacks (Horovod's hook; nothing by default)."""

    # -- dtrain: the durable copy ----------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """A private copy of the last ``save()``, for the disk."""
        raise NotImplementedError

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Make ``snapshot`` the last ``save()`` and ``restore()`` it."""
        raise NotImplementedError


class ObjectState(State):
    """Plain Python attributes, given as keyword arguments; synchronised by ``broadcast_object``."""

    def __init__(self, bcast_object: Callable[..., Any] | None = None, get_rank: Callable[[], int] | None = None,
                 **kwargs: Any) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self, root_rank: int = 0) -> None:
        if self._saved_state:
            self._saved_state = ops.broadcast_object(self._saved_state, root_rank)
            self._set_attrs()

    def snapshot(self) -> dict[str, Any]:
        return {"attrs": self._saved_state}  # replaced by each save(), never changed in place

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        self._saved_state = snapshot["attrs"]
        self.restore()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


class StateHandler:
    """Saves, restores and synchronises one object of a ``TorchState``."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved = self.state_dict()

    def state_dict(self) -> Any:
        return copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self.saved = self.state_dict()

    def restore(self) -> None:
        # A copy: load_state_dict keeps tensors it need not move, which the next step would change.
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self, root_rank: int) -> None:
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    def sync(self, root_rank: int) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=root_rank)


class OptimizerStateHandler(StateHandler):
    def sync(self, root_rank: int) -> None:
        broadcast_optimizer_state(self.value, root_rank=root_rank)


class SamplerStateHandler(StateHandler):
    def sync(self, root_rank: int) -> None:
        self.value.load_state_dict(ops.broadcast_object(self.value.state_dict(), root_rank))


_handler_registry: list[tuple[type, type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type[StateHandler]]]:
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type[StateHandler]]]) -> None:
    global _handler_registry
    _handler_registry = registry


class TorchState(ObjectState):
    """A PyTorch training's state: ``model``, ``optimizer`` (and any other models, optimizers and
    ``ElasticSampler`` objects given by keyword) plus plain attributes such as ``epoch=1, batch=0``."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            cls = next((h for t, h in _handler_registry if isinstance(value, t)), None)
            if cls is not None:
                handlers[name] = cls(value)
            else:
                plain[name] = value
        self._handlers: dict[str, StateHandler] = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(**plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self, root_rank: int = 0) -> None:
        """Give every rank ``root_rank``'s model, optimizer, samplers and attributes.
        Collective: call on every rank."""
        for handler in self._handlers.values():
            handler.sync(root_rank)
        super().sync(root_rank)

    def snapshot(self) -> dict[str, Any]:
        out = super().snapshot()
        out["handlers"] = {name: h.saved for name, h in self._handlers.items()}  # replaced by save(), never changed
        return out

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        for name, saved in snapshot["handlers"].items():
            if name in self._handlers:
                self._handlers[name].saved = saved
        super().load_snapshot(snapshot)
        for handler in self._handlers.values():
            handler.restore()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers and hasattr(self, name):
            handlers[name].set_value(value)
        super().__setattr__(name, value)
