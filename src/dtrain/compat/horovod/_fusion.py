"""Horovod's tensor fusion with overlap, for ``hvd.DistributedOptimizer``: gradients are all-reduced
while backward still runs.

Horovod registers a hook on every parameter that starts an asynchronous all-reduce once
backward has produced its gradient (``backward_passes_per_step`` times), and its background
thread fuses whatever is ready into buffers (horovod/torch/optimizer.py, docs/tensor-fusion.rst).
Here the fusion is planned once, as DDP's buckets are (torch/csrc/distributed/c10d/reducer.cpp):
the parameters, last layers first (backward produces their gradients first), go into fixed
buckets of one dtype and device, the first small so that communication starts early. A bucket
is fused into one flat buffer and handed to the engine thread as soon as all its gradients are
ready, and buckets go out strictly in order, so every rank submits the same operations in the
same order (the engine matches operations by order; a bucket launched early on one rank and
late on another still pairs up). ``flush()`` (the optimizer's ``synchronize()``) sends what
backward did not (gradients a rank's graph did not produce travel as zeros), waits for every
bucket and writes the results back into ``.grad``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

FIRST_BUCKET_BYTES = 1 * 2**20  # DDP's first bucket: the last layers' gradients leave early
BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb; HOROVOD_FUSION_THRESHOLD overrides it


def bucket_bytes() -> int:
    """Bucket size: ``HOROVOD_FUSION_THRESHOLD`` (bytes; Horovod's knob) or 25 MiB."""
    raw = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    return max(int(raw), 1) if raw and raw.isdigit() else BUCKET_BYTES


def plan(params: list[nn.Parameter], first: int, cap: int) -> list[list[nn.Parameter]]:
    """Fixed buckets of ``params`` in reverse order, one dtype and device each, up to ``cap`` bytes
    (the first up to ``first``)."""
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
        self.launched: tuple[torch.Tensor, Any] | None = None  # (flat buffer, what reduce returned)


class GradientFusion:
    """Fixed buckets of ``params`` whose gradients ``launch(flat)`` sends (asynchronously) and
    ``finish(flat, sent)`` waits for, returning the reduced flat buffer."""

    def __init__(self, params: list[nn.Parameter], passes: int,
                 launch: Callable[[torch.Tensor], Any], finish: Callable[[torch.Tensor, Any], torch.Tensor]) -> None:
        self.buckets = [_Bucket(b) for b in plan(params, FIRST_BUCKET_BYTES, bucket_bytes())]
        self._where = {p: b for b in self.buckets for p in b.params}
        self._passes = {p: 0 for p in params}
        self.passes = passes
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
        if bucket.launched is not None:
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
        """Send every bucket backward did not, wait for all of them, write the results into ``.grad``.
        Collective: call on every rank of the set."""
        sparse = [p for p in self._where if p.grad is not None and p.grad.is_sparse]
        for p in sparse:
            p.grad = p.grad.to_dense()
        for p in self._where:
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)  # as Horovod: a gradient this rank's graph did not produce
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
                bucket.ready.clear()
        for p in sparse:
            p.grad = p.grad.to_sparse()
        self._next = 0
        for p in self._passes:
            self._passes[p] = 0
