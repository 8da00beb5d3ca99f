"""The training step: the model and optimizer wrappers ``ctx.setup`` returns, the accumulation
window, backward (loss division, fp16 scaling), the staged step and gradient clipping.

``Step`` holds the step's state (which micro-step of which window, the optimizers and models it
wrapped); ``Context`` delegates to it, so a script sees ``ctx.accumulate``, ``ctx.backward``, ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .. import _check as check
from ..comm.collectives import Collectives
from ..errors import ConfigError
from ..metrics.breakdown import SCHEDULE, StepBreakdown
from ..parallel import float8
from ..parallel.convnets import to_channels_last
from ..precision import Precision, scaler_skips_itself
from ..strategies.base import ForwardingOptimizer, Strategy


class DtrainModule(nn.Module):
    """The model as ``ctx.setup`` returns it: the strategy's wrapper, run under the precision's
    autocast. ``state_dict`` and ``load_state_dict`` are the user's module's own, so checkpoints
    carry no wrapper prefixes."""

    def __init__(self, wrapped: nn.Module, original: nn.Module, precision: Precision, channels_last: bool = False,
                 autocast: bool = True) -> None:
        super().__init__()
        self.module = wrapped
        object.__setattr__(self, "original", original)  # not a submodule: no duplicate state
        object.__setattr__(self, "_autocast", precision.autocast if autocast else contextlib.nullcontext)
        object.__setattr__(self, "_channels_last", channels_last)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._channels_last:
            args = to_channels_last(args)
        with self._autocast():
            return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.original.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.original.load_state_dict(state_dict, strict=strict, assign=assign)


class DtrainOptimizer(ForwardingOptimizer):
    """The optimizer as ``ctx.setup`` returns it. ``step`` and ``zero_grad`` do nothing on
    micro-steps inside ``ctx.accumulate`` that are not the last of their window, and go through
    the GradScaler when the precision uses one."""

    def __init__(self, optimizer: torch.optim.Optimizer, step: Step) -> None:
        super().__init__(optimizer)
        self._step = step
        if step.scaler is not None:
            scaler_skips_itself(optimizer)  # torch's fused SGD mishandles a skipped step

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        run = self._step
        if not run.sync:
            return None
        tracker = run.collectives.tracker
        tracker.beat(tracker.step + 1)
        run.breakdown.lap("rest")
        scaler = run.scaler
        if scaler is not None:
            # An optimizer that communicates (hvd) must finish before the scaler unscales.
            synchronize = getattr(self.optimizer, "synchronize", None)
            if synchronize is not None:
                synchronize()
            out = scaler.step(self.optimizer, closure) if closure else scaler.step(self.optimizer)
            scaler.update()
        else:
            out = self.optimizer.step(closure) if closure else self.optimizer.step()
        for model in run.float8_scaled:  # the next all-gathers' float8 scales, in one all-reduce
            float8.after_step(model)
        run.strategy.after_optimizer_step(self.optimizer)  # e.g. local SGD averages parameters (a collective)
        run.breakdown.lap("optimizer")
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._step.sync:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"DtrainOptimizer({self.optimizer!r})"


def inner_module(model: nn.Module) -> nn.Module:
    """The strategy's wrapper inside a ``DtrainModule`` (the module itself otherwise)."""
    return model.module if isinstance(model, DtrainModule) else model


class Step:
    """The state of the training step, and its operations."""

    def __init__(self, *, strategy: Strategy, precision: Precision, collectives: Collectives) -> None:
        self.strategy = strategy
        self.precision = precision
        self.collectives = collectives
        self.scaler = precision.grad_scaler()
        self.accum_steps = 1
        self.micro_step = 0
        self.sync = True
        """True when the current micro-step ends an accumulation window (always outside one)."""
        self.end_of_data = False
        self.optimizers: list[DtrainOptimizer] = []
        self.float8_scaled: list[nn.Module] = []
        """Sharded models whose float8 weights' scales are computed after each optimizer step."""
        self.modules: list[weakref.ref[DtrainModule]] = []
        self.breakdown = StepBreakdown(collectives.world.device)
        """Where this rank's step time goes: backward and the optimizer mark their phases."""

    # -- wrappers ----------------------------------------------------------------------------------
    def wrap_model(self, inner: nn.Module, channels_last: bool) -> DtrainModule:
        place = self.strategy.placement
        # fully_shard's policy already runs forward and backward in the 16-bit type (its gathered
        # parameters and cast inputs): autocast off, as torchtitan (maybe_enable_amp). The ops
        # autocast would run in fp32 (norms, softmax) then run in the 16-bit type with fp32
        # accumulation, and a task computes its loss in fp32 (the lm's loss_fn casts the logits).
        cast_by_fsdp = place is not None and place.param_dtype is not None
        if place is not None and place.float8_all_gather:
            self.float8_scaled.append(inner)
        auto8 = self.precision.float8 is not None and self.precision.float8.auto
        if auto8 and place is not None and place.float8_linears == 0:  # --fast picked float8, but nothing gains
            self.precision = dataclasses.replace(self.precision, name="bf16-mixed", float8=None)
        wrapped = DtrainModule(inner, self.strategy.unwrap(inner), self.precision, channels_last=channels_last,
                               autocast=not cast_by_fsdp)
        self.modules.append(weakref.ref(wrapped))
        return wrapped

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> DtrainOptimizer:
        inner = inner_module(model) if model is not None else None
        wrapped = DtrainOptimizer(self.strategy.setup_optimizer(optimizer, inner), self)
        self.optimizers.append(wrapped)
        return wrapped

    def release_modules(self) -> None:
        """Point every wrapped model at the user's own module again, dropping the strategy's
        wrapper (DDP): one that outlives its process group can abort the process at exit."""
        for ref in self.modules:
            module = ref()
            if module is not None and module.module is not module.original:
                module.module = module.original
        self.modules.clear()

    # -- accumulation ------------------------------------------------------------------------------
    def set_end_of_data(self, last: bool) -> None:
        self.end_of_data = last
        if not last:
            self.micro_step = 0  # a new epoch starts a new accumulation window

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module, steps: int = 1) -> Iterator[None]:
        check.integer("ctx.accumulate(model, steps=...)", steps, minimum=1)
        self.accum_steps = steps
        self.micro_step += 1
        # A window cut short by the end of the epoch still syncs, so no gradient is left behind.
        self.sync = self.micro_step % steps == 0 or self.end_of_data
        try:
            with contextlib.nullcontext() if self.sync else self.strategy.no_sync(inner_module(model)):
                yield
        finally:
            if self.sync:
                self.micro_step = 0

    # -- forward, backward, clipping -----------------------------------------------------------------
    def forward_backward(self, model: nn.Module, inputs: Any, target: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        if self.strategy.capabilities.staged_step and self.collectives.world.distributed:
            loss = self.strategy.forward_backward(inner_module(model), inputs, target, loss_fn,
                                                  accumulation_steps=self.accum_steps, precision=self.precision,
                                                  collectives=self.collectives)
            self.breakdown.lap(SCHEDULE)  # forward, backward and sends, interleaved: one lap (metrics/breakdown.py)
            return loss
        loss = loss_fn(model(inputs), target)
        self.backward(loss)
        return loss.detach()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.accum_steps > 1:
            loss = loss / self.accum_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        tracker = self.collectives.tracker
        self.breakdown.backward_starts(loss)
        if self.collectives.world.distributed and self.sync:
            # Gradients are communicated inside backward (DDP buckets, hvd hooks): record it as
            # a collective for the watchdog, and check it against the other ranks in debug mode.
            with self.collectives.labelled("backward (gradient all-reduce)", loss):
                loss.backward(**kwargs)
        else:
            tracker.beat()
            loss.backward(**kwargs)
            tracker.beat()
        self.breakdown.backward_done()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        check.instance("ctx.clip_grad_norm_(model, max_norm)", max_norm, (int, float), "give a number > 0")
        if not max_norm > 0:  # inf is allowed: torch's idiom for "measure the norm, clip nothing"
            raise ConfigError(f"ctx.clip_grad_norm_(model, max_norm) must be > 0, got {max_norm}.")
        if self.scaler is not None:
            for opt in self.optimizers:
                self.scaler.unscale_(opt.optimizer)
        return self.strategy.clip_grad_norm_(model.parameters(), max_norm, norm_type)
