"""``hvd.DistributedOptimizer`` and the broadcasts a Horovod script starts with."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from dtrain import ConfigError
from dtrain.strategies.hvd import GradientFusion, match_names

from . import _basics
from . import _ops as ops
from ._compression import Compression, check_compressor

FIRST_BUCKET_BYTES = 1 * 2**20  # DDP's first bucket: the last layers' gradients leave early
BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb; HOROVOD_FUSION_THRESHOLD overrides it


def bucket_bytes() -> int:
    """Bucket size: ``HOROVOD_FUSION_THRESHOLD`` (bytes; Horovod's knob) or 25 MiB."""
    raw = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    return max(int(raw), 1) if raw and raw.isdigit() else BUCKET_BYTES


class _DistributedMixin:
    """Methods added to the user's optimizer class (the result is still e.g. a ``torch.optim.SGD``)."""

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op, predivide, process_set):
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            by_param, dupes, missing = match_names(list(named_parameters), params)
            if dupes:
                raise ValueError(f"named_parameters has duplicate names {dupes}; give each parameter its own name.")
            if missing:
                raise ValueError(f"named_parameters misses {missing} of the optimizer's parameters; pass "
                                 "model.named_parameters() for every parameter the optimizer holds, or None.")
        else:
            by_param = {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
        self._parameter_names = {p: by_param[p] for p in params}
        self._compression = compression
        self._op = op
        self._predivide = predivide
        self._process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        self._synchronized = False
        self._should_synchronize = True

        self._fusion: GradientFusion | None = None
        if self._communicates():
            grads = [p for p in params if p.requires_grad]
            # Buckets planned once (Horovod fuses whatever is ready): every rank sends the same
            # operations in the same order, which the engine thread matches by order.
            self._fusion = GradientFusion(grads, backward_passes_per_step, self._launch, self._finish,
                                          first=FIRST_BUCKET_BYTES, cap=bucket_bytes())
            if process_set.size() > 1:
                self._fusion.register_hooks()  # gradients leave while backward still runs

    def _communicates(self) -> bool:
        ps = self._process_set
        return ps.ranks is None or (ps.included() and ps.size() > 1)

    def synchronize(self) -> None:
        """Wait for every gradient's all-reduce (starting those backward did not, as zeros where
        this rank's graph made none) and write the results into ``.grad``. Collective over the set."""
        if self._fusion is not None:
            self._fusion.flush()
        self._synchronized = True

    def _launch(self, flat: torch.Tensor) -> tuple:
        """Start reducing one fused buffer (op, predivide and compression as configured)."""
        pre, post, op = 1.0, 1.0, self._op
        if op == ops.Average and self._predivide != 1.0:
            op, pre, post = ops.Sum, 1.0 / self._predivide, self._predivide / self._process_set.size()
        wire, cctx = self._compression.compress(flat)
        handle = ops.allreduce_async_(wire, op=op, prescale_factor=pre, postscale_factor=post, process_set=self._process_set)
        return wire, cctx, handle

    def _finish(self, flat: torch.Tensor, sent: tuple) -> torch.Tensor:
        wire, cctx, handle = sent
        ops.synchronize(handle)
        return self._compression.decompress(wire, cctx) if wire is not flat else flat

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside uses the gradients as they are (after an explicit ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._fusion is not None:
            if self._fusion.in_flight():  # Horovod's rule: the all-reduces would write into cleared gradients
                raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                                     "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
            self._fusion.discard()
        self._synchronized = False
        return super().zero_grad(set_to_none)  # type: ignore[misc]


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, nn.Parameter]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = ops.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
) -> torch.optim.Optimizer:
    """The user's optimizer, whose ``step()`` first reduces every gradient over the ranks
    (``synchronize()``). ``backward_passes_per_step``: gradients accumulate locally over that many
    backward passes; the script calls ``step()`` after them, as with Horovod."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"hvd.DistributedOptimizer got {type(optimizer).__name__} {optimizer!r:.40}; "
                          "give a torch.optim.Optimizer (e.g. torch.optim.SGD(model.parameters(), lr=0.1)).")
    compression = check_compressor(compression)
    op = ops._op(None, op)
    if op not in (ops.Average, ops.Sum, ops.Adasum):
        raise ConfigError(f"DistributedOptimizer op must be hvd.Average, hvd.Sum or hvd.Adasum, got {op!r}.")
    if backward_passes_per_step < 1:
        raise ConfigError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}.")
    if gradient_predivide_factor != 1.0 and op != ops.Average:
        raise ConfigError("gradient_predivide_factor needs op=hvd.Average; drop one of them.")
    cls = type(type(optimizer).__name__, (_DistributedMixin, type(optimizer)), {})
    dist_opt = cls.__new__(cls)
    dist_opt.__dict__.update(optimizer.__dict__)  # the same param_groups and state, shared
    dist_opt._hvd_setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                        _basics.resolve(process_set))
    return dist_opt


# -- broadcasts -----------------------------------------------------------------------------
def broadcast_parameters(params: Any, root_rank: int, process_set: Any = None) -> None:
    """Copy ``root_rank``'s tensors to every rank, in place. ``params`` is a ``state_dict()`` or
    an iterable of ``(name, tensor)`` such as ``model.named_parameters()``. Collective."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    handles = [ops.broadcast_async_(t.data if isinstance(t, nn.Parameter) else t, root_rank, process_set=process_set)
               for _, t in items if torch.is_tensor(t)]
    for h in handles:
        ops.synchronize(h)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, process_set: Any = None) -> None:
    """Give every rank ``root_rank``'s optimizer state. Collective. An optimizer that has not
    stepped gets its state made first by a step on zero gradients (parameters put back), as Horovod does."""
    if not optimizer.state_dict()["state"]:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        saved = [p.detach().clone() for p in params]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        step = super(_DistributedMixin, optimizer).step if isinstance(optimizer, _DistributedMixin) else optimizer.step
        step()
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
    state = ops.broadcast_object(optimizer.state_dict() if _basics.rank() == root_rank else None, root_rank,
                                 process_set=process_set)
    if _basics.rank() != root_rank:
        optimizer.load_state_dict(state)
