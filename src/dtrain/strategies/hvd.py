"""Horovod's method on torch.distributed: the optimizer all-reduces gradients, fused into fixed
buckets (last layers first) each sent as soon as backward has produced it; ``step()`` waits for
them. ``dtrain.compat.horovod``'s ``DistributedOptimizer`` shares ``GradientFusion``.
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
from .base import Capabilities, ForwardingOptimizer, Strategy

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


def plan(params: list[nn.Parameter], first: int, cap: int) -> list[list[nn.Parameter]]:
    """Fixed buckets of ``params`` in reverse order (backward produces the last layers' gradients
    first), one dtype and device each, up to ``cap`` bytes (the first up to ``first``), as DDP's."""
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        last = out[-1] if out else None
        limit = first if len(out) == 1 else cap
        if last and last[0].dtype == p.dtype and last[0].device == p.device and size + nbytes <= limit:
            last.append(p)
            size += nbytes
        else:
            out.append([p])
            size = nbytes
    return out


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.ready: set[nn.Parameter] = set()
        self.launched: tuple[torch.Tensor, Any] | None = None  # (flat buffer, what launch returned)


class GradientFusion:
    """Horovod's tensor fusion with overlap: ``launch(flat)`` sends a bucket once backward has
    produced all its gradients (``passes`` times), strictly in bucket order so every rank issues the
    same collectives; ``finish(flat, sent)`` waits for one and returns the reduced buffer."""

    def __init__(self, params: list[nn.Parameter], passes: int, launch: Callable[[torch.Tensor], Any],
                 finish: Callable[[torch.Tensor, Any], torch.Tensor], *, first: int, cap: int) -> None:
        self.buckets = [_Bucket(b) for b in plan(params, first, cap)]
        self._where = {p: b for b in self.buckets for p in b.params}
        self._passes = {p: 0 for p in params}
        self.passes = passes
        self.enabled = True
        """False inside micro-steps that only accumulate locally (``no_sync``): nothing is counted or sent."""
        self._launch, self._finish = launch, finish
        self._next = 0  # the first bucket not launched yet
        self._hooks: list[Any] = []

    def register_hooks(self) -> None:
        self._hooks = [p.register_post_accumulate_grad_hook(self.on_grad) for p in self._where]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def in_flight(self) -> bool:
        return self._next > 0

    def discard(self) -> None:
        """Forget the passes counted so far (``zero_grad`` drops their gradients)."""
        for bucket in self.buckets:
            bucket.ready.clear()
        for p in self._passes:
            self._passes[p] = 0

    def on_grad(self, p: nn.Parameter) -> None:
        """Backward accumulated ``p``'s gradient: count the pass; launch what is complete, in order."""
        bucket = self._where[p]
        if not self.enabled or bucket.launched is not None:
            return  # a pass beyond backward_passes_per_step: Horovod ignores it too
        self._passes[p] += 1
        if self._passes[p] >= self.passes and p.grad is not None and not p.grad.is_sparse:
            bucket.ready.add(p)
        while self._next < len(self.buckets):
            nxt = self.buckets[self._next]
            if len(nxt.ready) < len(nxt.params):
                break
            self._send(nxt)

    def _send(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1).clone()
        bucket.launched = (flat, self._launch(flat))
        self._next += 1

    def flush(self) -> None:
        """Send every bucket backward did not (a gradient this rank's graph did not produce as
        zeros, as Horovod), wait for all of them, write the results into ``.grad``.

        Collective: call on every rank of the group."""
        sparse = [p for p in self._where if p.grad is not None and p.grad.is_sparse]
        for p in sparse:
            p.grad = p.grad.to_dense()
        for p in self._where:
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        while self._next < len(self.buckets):
            self._send(self.buckets[self._next])
        with torch.no_grad():
            for bucket in self.buckets:
                flat, sent = bucket.launched  # type: ignore[misc]
                reduced = self._finish(flat, sent)
                at = 0
                for p in bucket.params:
                    n = p.numel()
                    if p.grad is not None:
                        p.grad.copy_(reduced[at: at + n].view_as(p.grad))
                    at += n
                bucket.launched = None
        for p in sparse:
            p.grad = p.grad.to_sparse()
        self._next = 0
        self.discard()


class GradientAllReduceOptimizer(ForwardingOptimizer):
    """Wraps ``optimizer``: gradients are all-reduced as backward produces them (``GradientFusion``);
    ``step`` waits for them first. ``synchronize()`` waits without stepping (e.g. to clip
    gradients), after which ``with opt.skip_synchronize(): opt.step()`` steps without waiting again."""

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
        self.fusion = GradientFusion(params, self.config.backward_passes_per_step, self._launch, self._finish,
                                     first=int(self.config.first_bucket_mb * 2**20),
                                     cap=int(self.config.fusion_threshold_mb * 2**20))
        self._synchronized = False
        self.bytes_communicated = 0
        """Bytes handed to all-reduce so far (after compression), for benchmarks."""
        if self._size > 1:
            self.fusion.register_hooks()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.fusion.in_flight():
            raise ConfigError("zero_grad() called while gradients are being all-reduced; call step() or synchronize() first.")
        self.fusion.discard()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        return self.optimizer.step(closure) if closure else self.optimizer.step()

    def __repr__(self) -> str:
        return f"GradientAllReduceOptimizer({self.optimizer!r}, {self.config})"

    def _launch(self, flat: torch.Tensor) -> tuple[torch.Tensor, Any]:
        buffer = flat.to(COMPRESSIONS[self.config.compression] or flat.dtype)
        if self.config.gradient_predivide_factor != 1.0:
            buffer.div_(self.config.gradient_predivide_factor)
        self.bytes_communicated += buffer.numel() * buffer.element_size()
        return buffer, dist.all_reduce(buffer, group=self._group, async_op=True)

    def _finish(self, flat: torch.Tensor, sent: tuple[torch.Tensor, Any]) -> torch.Tensor:
        buffer, work = sent
        work.wait()
        factor = self.config.gradient_predivide_factor
        scale = factor / self._size if self.config.op == "average" else factor
        return buffer.mul_(scale) if scale != 1.0 else buffer

    def synchronize(self) -> None:
        """Wait for every gradient's all-reduce and write the results into ``.grad``.

        Collective: call on every rank (gradients that backward did not produce this step are
        all-reduced here as zeros, so every rank issues the same collectives)."""
        self._synchronized = True
        if self._size > 1:
            self.fusion.flush()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not wait again (use after ``synchronize()``)."""
        self._synchronized = True
        yield


def match_names(named: list[tuple[str, nn.Parameter]], params: list[nn.Parameter]) -> tuple[dict[nn.Parameter, str], list[str], int]:
    """{parameter: name}, the names given twice, and how many of ``params`` have none (each caller
    raises its own error)."""
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
        model = model.to(world.device)
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
            opt.fusion.enabled = False
        try:
            yield
        finally:
            for opt in self._optimizers:
                opt.fusion.enabled = True
