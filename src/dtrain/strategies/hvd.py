"""Horovod's method on torch.distributed: the optimizer all-reduces gradients.

Each gradient is handed to an asynchronous all-reduce as soon as backward has accumulated it
(``register_post_accumulate_grad_hook``); gradients that become ready together are fused into
one flat buffer (Horovod's "tensor fusion"), and ``step()`` waits for the buffers, writes the
averaged gradients back and steps. No process of its own, no MPI: the collectives are
torch.distributed's, on the process group ``dtrain.init`` joined.

The ``hvd`` strategy uses ``GradientAllReduceOptimizer`` behind ``ctx.setup``.
(``dtrain.compat.horovod`` is built on the public API and has its own optimizer wrapper.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..parallel.placement import Placement
from ..world import World
from . import register
from .base import Capabilities, ForwardingOptimizer, Strategy, move_to_device

OPS = ("average", "sum")
COMPRESSIONS = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class HvdConfig:
    op: str = "average"
    """How gradients are combined over ranks: ``average`` or ``sum``."""
    compression: str = "none"
    """Wire format of the all-reduce: ``none`` (the gradient's dtype), ``fp16`` or ``bf16``."""
    backward_passes_per_step: int = 1
    """Backward passes accumulated locally before one all-reduce (Horovod's name)."""
    first_bucket_mb: float = 1.0
    """The first fused buffer is launched once it holds this much: the last layers' gradients
    are ready first, and sending them early overlaps communication with the rest of backward."""
    fusion_threshold_mb: float = 25.0
    """Later fused buffers are launched once they hold this much."""
    gradient_predivide_factor: float = 1.0
    """Divide by this before the sum and by size/factor after it (Horovod's option)."""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            hint = " Adasum is not supported by dtrain; use op=Average." if self.op == "adasum" else ""
            raise ConfigError(f"unknown all-reduce op {self.op!r}; choose one of: {', '.join(OPS)}.{hint}")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"unknown compression {self.compression!r}; choose one of: {', '.join(COMPRESSIONS)}.")
        if self.backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {self.backward_passes_per_step}.")
        if self.first_bucket_mb <= 0 or self.fusion_threshold_mb <= 0:
            raise ConfigError("first_bucket_mb and fusion_threshold_mb must be > 0.")
        if self.gradient_predivide_factor <= 0:
            raise ConfigError(f"gradient_predivide_factor must be > 0, got {self.gradient_predivide_factor}.")


class _Bucket:
    """Gradients fused into one buffer and the all-reduce in flight for them."""

    def __init__(self, params: list[nn.Parameter], buffer: torch.Tensor, work: Any) -> None:
        self.params, self.buffer, self.work = params, buffer, work


class GradientAllReduceOptimizer(ForwardingOptimizer):
    """Wraps ``optimizer``: gradients are all-reduced as backward produces them; ``step`` waits
    for them first. ``synchronize()`` waits without stepping (e.g. to clip gradients), after
    which ``with opt.skip_synchronize(): opt.step()`` steps without waiting again."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, nn.Parameter]] | None = None,
        config: HvdConfig | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(optimizer)
        self.config = config or HvdConfig()
        self._group = group
        self._size = dist.get_world_size(group) if dist.is_initialized() else 1
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._names = _check_names(named_parameters, params)
        self._params = params
        self._passes = {p: 0 for p in params}
        self._pending: list[nn.Parameter] = []
        self._pending_bytes = 0
        self._buckets: list[_Bucket] = []
        self._launched: set[nn.Parameter] = set()
        self._synchronized = False
        self.sync_enabled = True
        """False inside ``ctx.accumulate`` micro-steps that only accumulate locally."""
        self.bytes_communicated = 0
        """Bytes handed to all-reduce so far (after compression), for benchmarks."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params] if self._size > 1 else []

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._buckets:
            raise ConfigError("zero_grad() called while gradients are being all-reduced; call step() or synchronize() first.")
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        return self.optimizer.step(closure) if closure else self.optimizer.step()

    def __repr__(self) -> str:
        return f"GradientAllReduceOptimizer({self.optimizer!r}, {self.config})"

    # -- communication -------------------------------------------------------------------------
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync_enabled or p in self._launched:
            return
        self._passes[p] += 1
        if self._passes[p] < self.config.backward_passes_per_step:
            return
        self._pending.append(p)
        self._pending_bytes += p.grad.numel() * p.grad.element_size()
        cap = self.config.first_bucket_mb if not self._buckets else self.config.fusion_threshold_mb
        if self._pending_bytes >= cap * 2**20:
            self._launch()

    def _launch(self) -> None:
        params, self._pending, self._pending_bytes = self._pending, [], 0
        grads = [p.grad for p in params]
        if any(g.is_sparse for g in grads):
            raise ConfigError("sparse gradients are not supported by dtrain's Horovod optimizer; use dense embeddings.")
        wire = COMPRESSIONS[self.config.compression] or grads[0].dtype
        buffer = torch.cat([g.reshape(-1).to(wire) for g in grads])
        if self.config.gradient_predivide_factor != 1.0:
            buffer.div_(self.config.gradient_predivide_factor)
        self.bytes_communicated += buffer.numel() * buffer.element_size()
        work = dist.all_reduce(buffer, group=self._group, async_op=True)
        self._buckets.append(_Bucket(params, buffer, work))
        self._launched.update(params)

    def synchronize(self) -> None:
        """Wait for every gradient's all-reduce and write the results into ``.grad``.

        Collective: call on every rank (gradients that backward did not produce this step are
        all-reduced here as zeros, so every rank issues the same collectives)."""
        self._synchronized = True
        if self._size == 1:
            return
        queued = self._launched | set(self._pending)  # sets: tensors compare by identity there
        for p in self._params:
            if p not in queued:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._pending.append(p)
        if self._pending:
            self._launch()
        scale = self._post_scale()
        for bucket in self._buckets:
            bucket.work.wait()
            if scale != 1.0:
                bucket.buffer.mul_(scale)
            offset = 0
            for p in bucket.params:
                n = p.grad.numel()
                p.grad.copy_(bucket.buffer[offset : offset + n].view_as(p.grad))
                offset += n
        self._buckets.clear()
        self._launched.clear()
        for p in self._params:
            self._passes[p] = 0

    def _post_scale(self) -> float:
        factor = self.config.gradient_predivide_factor
        if self.config.op == "average":
            return factor / self._size
        return factor

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not wait again (use after ``synchronize()``)."""
        self._synchronized = True
        yield

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def match_names(named: list[tuple[str, nn.Parameter]], params: list[nn.Parameter]) -> tuple[dict[nn.Parameter, str], list[str], int]:
    """``named_parameters`` matched to an optimizer's parameters: {parameter: name}, the names given
    more than once, and how many of ``params`` have no name. The callers raise their own errors on
    the last two: this strategy a ConfigError, ``dtrain.compat.horovod`` the ValueError Horovod raises."""
    names = [n for n, _ in named]
    dupes = sorted({n for n in names if names.count(n) > 1})
    by_param = {p: n for n, p in named}
    return by_param, dupes, sum(p not in by_param for p in params)


def _check_names(named_parameters: Iterable[tuple[str, nn.Parameter]] | None, params: list[nn.Parameter]) -> dict[nn.Parameter, str]:
    if named_parameters is None:
        return {p: f"param.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ConfigError("named_parameters must be (name, parameter) pairs, e.g. model.named_parameters().")
    by_param, dupes, missing = match_names(named, params)
    if dupes:
        raise ConfigError(f"named_parameters has duplicate names {dupes}; pass model.named_parameters().")
    if missing:
        raise ConfigError(
            f"{missing} optimizer parameter(s) are not in named_parameters; pass the named_parameters "
            "of the model the optimizer was built from."
        )
    return by_param


@register("hvd")
class HorovodStrategy(Strategy):
    """Parameters broadcast from rank 0 at setup; gradients all-reduced by the optimizer."""

    name = "hvd"
    capabilities = Capabilities()

    def __init__(self, config: HvdConfig | None = None, **options: Any) -> None:
        self.config = config or HvdConfig(**options)
        self._optimizers: list[GradientAllReduceOptimizer] = []
        self._group: dist.ProcessGroup | None = None

    def replicate(self, model: nn.Module, world: World, place: Placement) -> nn.Module:
        """Rank 0's parameters and buffers on every replica; the optimizer all-reduces later."""
        model = move_to_device(model, world)
        self._group = place.group("dp_replicate")
        if world.distributed:
            with torch.no_grad():
                for t in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(t, src=0, group=self._group)
        return model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        named = model.named_parameters() if model is not None else None
        opt = GradientAllReduceOptimizer(optimizer, named, config=self.config, group=self._group)
        self._optimizers.append(opt)
        return opt

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        for opt in self._optimizers:
            opt.sync_enabled = False
        try:
            yield
        finally:
            for opt in self._optimizers:
                opt.sync_enabled = True
