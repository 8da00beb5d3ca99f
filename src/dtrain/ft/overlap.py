"""The gradient average over the quorum overlapped with backward, as DDP overlaps its all-reduce:
DDP's buckets, each handed to torchft's asynchronous ``Manager.allreduce`` as soon as backward has
produced its gradients, all waited for before the commit vote. torchft's own DDP comm hook fails
an assertion when a peer dies mid-all-reduce (benchmarks/ft_ddp_peer_loss.py); a plain
``Manager.allreduce`` reports it through its ``wait()``, and the vote fails the step for everyone.

Used in a replica group of one process; where a group's own collectives make the gradient (FSDP,
TP, a pipeline), the average stays one flat all-reduce after backward (``session.average_gradients``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .session import average_gradients

FIRST_BUCKET_BYTES = 1 * 2**20
"""DDP's first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``): the last layers' gradients leave early."""
BUCKET_BYTES = 25 * 2**20
"""DDP's ``bucket_cap_mb`` default."""


def ddp_buckets(params: list[nn.Parameter], first: int = FIRST_BUCKET_BYTES, cap: int = BUCKET_BYTES) -> list[list[nn.Parameter]]:
    """DDP's buckets as it rebuilds them after its first step: the parameters in the order backward
    produces their gradients (taken as the reverse of registration), each bucket closed once it
    holds at least its limit (``first`` for the first, then ``cap``), one dtype and device each
    (torch's ``_compute_bucket_assignment_by_size``). Closing at, not before, the limit matters:
    the MNIST net's 4.7 MB fc1 weight then leaves with the first bucket, under the convolutions'
    backward (Horovod's rule, ``strategies.hvd.plan``, would hold it until backward ends)."""
    out: list[list[nn.Parameter]] = []
    bucket: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        if bucket and (bucket[0].dtype != p.dtype or bucket[0].device != p.device):
            out.append(bucket)
            bucket, size = [], 0
        bucket.append(p)
        size += p.numel() * p.element_size()
        if size >= (cap if out else first):
            out.append(bucket)
            bucket, size = [], 0
    return out + [bucket] if bucket else out


class Overlap:
    """``manager``'s all-reduce of ``params``' gradients, bucket by bucket during the backward that
    follows ``arm()``; ``finish()`` waits for them. Every group issues the same all-reduces in the
    same order: a bucket is launched only after the ones before it, and what backward did not
    produce (an unused parameter: zeros, as the flat path) is launched by ``finish``."""

    def __init__(self, manager: Any, params: Iterable[nn.Parameter]) -> None:
        self.manager = manager
        self.buckets = ddp_buckets([p for p in params if p.requires_grad])
        self._where = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._ready: list[set[nn.Parameter]] = [set() for _ in self.buckets]
        self._sent: list[tuple[torch.Tensor, Any]] = []
        """Each launched bucket's flat buffer and torchft's Work for it, in bucket order."""
        self.armed = False
        """True during the backward whose gradients are averaged (a window's last micro-batch)."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._where]

    def arm(self) -> None:
        """The next backward produces the step's gradients (``--grad-accum K``: its last micro-batch)."""
        assert not self._sent, "Overlap.arm() before the previous step's finish()"
        for ready in self._ready:
            ready.clear()
        self.armed = True

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.armed:
            return  # a micro-batch that only accumulates
        self._ready[self._where[p]].add(p)
        while len(self._sent) < len(self.buckets) and len(self._ready[len(self._sent)]) == len(self.buckets[len(self._sent)]):
            self._launch(self.buckets[len(self._sent)])

    def _launch(self, bucket: list[nn.Parameter]) -> None:
        flat = _flatten_dense_tensors([p.grad for p in bucket])
        self._sent.append((flat, self.manager.allreduce(flat)))

    def finish(self, buffers: Iterable[torch.Tensor] = ()) -> None:
        """Launch the buckets backward did not, wait for every one, write the averages into ``.grad``;
        then the floating-point ``buffers`` (BatchNorm's statistics) in one flat all-reduce, as
        ``average_gradients``. A failed bucket is reported to the manager by its ``wait``: the step
        is not committed, and its gradients are not used.

        Collective over the quorum: call on every replica group, after backward."""
        self.armed = False
        for p in self._where:
            if p.grad is None:  # unused this step: every group must still send the same buckets
                p.grad = torch.zeros_like(p)
        while len(self._sent) < len(self.buckets):
            self._launch(self.buckets[len(self._sent)])
        with torch.no_grad():
            for bucket, (flat, work) in zip(self.buckets, self._sent):
                work.wait()
                grads = [p.grad for p in bucket]
                for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
                    grad.copy_(averaged)
        self._sent = []
        floats = [b for b in buffers if b.is_floating_point()]
        if floats:
            average_gradients(self.manager, (), floats)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
