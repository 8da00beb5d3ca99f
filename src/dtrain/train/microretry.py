"""``--micro-batch auto`` after the first batch: a step that runs out of memory on any rank is
retried with a smaller micro-batch and more accumulation, the batch kept, the job not restarted.

Every step of such a run is *guarded*: its micro-steps keep their gradients local (``no_sync``, so
a rank that fails midway leaves no all-reduce half done), then each rank's out-of-memory flag
travels with the first bucket of gradients (``average_gradients``: one collective, as DDP's). On
any flag nothing has stepped: every rank drops the try, puts back buffers and random states, and
runs the same batch with the next micro-batch down. The price: gradients travel after backward,
not overlapped with it, and with DDP's buffer broadcast (a collective in every forward) the flag
is agreed before each micro-step. ``DTRAIN_OOM_INJECT=RANK:BYTES@STEP`` tests this on a CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .._log import logger
from ..errors import ConfigError
from .microbatch import Budget, Fitter, Kept, divisors, listed

BUCKET_BYTES = 25 * 2**20
"""Gradients averaged per all-reduce (DDP's default bucket): a bounded extra copy of them at a time."""

Micro = Callable[[Any, Any, int], torch.Tensor]
"""One micro-step: ``(inputs, targets, accumulation) -> its loss`` (detached), backward done."""


class _PeerFailed(Exception):
    """Another rank's micro-step failed: this rank stops the try (it ran no collective since)."""


class Guard:
    """Every step of a ``--micro-batch auto`` run: the first one's search (``Fitter``), then each
    step tried, agreed, and retried smaller after an out-of-memory on any rank.

    Collective: every rank calls ``step`` for every batch, at the same point of the loop."""

    def __init__(self, ctx: Any, model: Any, optimizer: Any, fitter: Fitter, budget: Budget | None = None,
                 from_step: int = 0) -> None:
        self.ctx, self.model, self.optimizer, self.fitter = ctx, model, optimizer, fitter
        self.budget, self.from_step = budget, from_step
        self.retries: list[tuple[int, int, int]] = []
        """(step, micro-batch before, after) of every step retried."""

    def step(self, step: int, x: Any, y: Any, micro: Micro) -> torch.Tensor:
        """Train on the batch ``x``, ``y`` in micro-steps (``micro``), gradients averaged over the
        ranks, ready for ``optimizer.step()``; the loss summed over the micro-steps, divided by
        their number."""
        k = self.fitter.accum(x, y)  # the first batch: the search
        failed_at: list[tuple[int, list[int]]] = []
        while True:
            kept = Kept(self.model, self.ctx.device)
            loss, flags, mine, error = self._try(step, x, y, k, micro)
            if flags is None:  # the flag goes with the first bucket of gradients: one collective, not two
                flags = self._agree(mine) if self._each() else average_gradients(self.ctx, self.model, mine)
            if error is not None:
                raise error
            broken = _where(flags, 2)
            if broken:
                raise ConfigError(f"--micro-batch auto: step {step} failed on rank(s) {listed(broken)} with an error other than "
                                  "out-of-memory (that rank's error says which).")
            out = _where(flags, 1)
            if not out:
                break
            self._drop(kept)
            failed_at.append((self.fitter.batch // k, out))
            k = self._smaller(step, k, failed_at)
        if failed_at:
            self._log(step, failed_at, k)
        if self._each():  # the flag went alone: the gradients still to average
            average_gradients(self.ctx, self.model)
        return loss

    def record(self) -> dict[str, Any]:
        """The result record's fields: the search's, the micro-batch in use at the end, the retries."""
        out = self.fitter.record()
        if out and self.retries:
            m = self.fitter.batch // self.fitter.accumulation
            out.update(micro_batch=m, grad_accum=self.fitter.accumulation,
                       micro_batch_retries=[list(r) for r in self.retries])
        return out

    # -- one try -------------------------------------------------------------------------------
    def _each(self) -> bool:
        """True where the wrapper broadcasts buffers at the start of each forward (DDP with
        BatchNorm): a rank that failed must not be waited for there, so the flag is agreed before
        each micro-step after the first, and alone."""
        from ..context.step import inner_module

        return bool(getattr(inner_module(self.model), "will_sync_module_buffers", lambda: False)())

    def _try(self, step: int, x: Any, y: Any, k: int,
             micro: Micro) -> tuple[torch.Tensor, torch.Tensor | None, float, Exception | None]:
        """(the loss, the flags when they were agreed already, this rank's status (0: fine, 1: out
        of memory, 2: another error), that other error)."""
        from ..context.step import inner_module

        inner, each = inner_module(self.model), self._each()
        loss = torch.zeros((), device=self.ctx.device)
        watch = self.budget if self.budget is not None and step >= self.from_step else None
        try:
            with self.ctx.strategy.no_sync(inner):
                for i, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):
                    if each and i and _where(flags := self._agree(0.0), 1, 2):
                        raise _PeerFailed
                    with self._watched(watch):
                        loss += micro(xm, ym, k).float() / k
        except _PeerFailed:
            return loss, flags, 0.0, None
        except torch.OutOfMemoryError:  # the frames that held the activations are gone with the exception
            return loss, None, 1.0, None
        except Exception as exc:  # noqa: BLE001 - agreed first (in step), raised there
            return loss, None, 2.0, exc
        return loss, None, 0.0, None

    @contextlib.contextmanager
    def _watched(self, budget: Budget | None) -> Iterator[None]:
        """The fake device (``DTRAIN_OOM_INJECT=...@STEP``): parameters, gradients and the
        optimizer's state held, the micro-step's saved activations on top."""
        if budget is None:
            yield
            return
        params = list(self.model.parameters())
        state = sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor))
        resident = 2 * sum(p.numel() * p.element_size() for p in params) + state
        with budget.watch(resident, {id(p) for p in params}):
            yield

    def _agree(self, mine: float) -> torch.Tensor:
        """Every rank's status (0: fine, 1: out of memory, 2: another error). Collective."""
        flags = torch.zeros(self.ctx.world_size, dtype=torch.float32)
        flags[self.ctx.rank] = mine
        return self.ctx.all_reduce(flags.to(self.ctx.device), op="sum").cpu()

    # -- after an out-of-memory ----------------------------------------------------------------
    def _drop(self, kept: Kept) -> None:
        """Forget the failed try: its gradients, the accumulation window it opened, what its
        forwards changed; the cached blocks go back to the device before the retry."""
        for p in self.model.parameters():
            p.grad = None
        self.ctx._step.micro_step = 0  # a window cut by the exception: the retry opens a new one
        kept.restore()
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()

    def _smaller(self, step: int, k: int, failed_at: list[tuple[int, list[int]]]) -> int:
        """The accumulation of the next micro-batch down (the largest divisor of the batch at most
        half of the one that failed), kept for the rest of the run."""
        batch, m = self.fitter.batch, self.fitter.batch // k
        if m == 1:
            raise ConfigError(f"--micro-batch auto: step {step} ran out of memory on {self.ctx.device} even at one sample per "
                              f"micro-step (rank(s) {listed(failed_at[-1][1])}); the model alone is too large for it: shard it "
                              "(--strategy fsdp), use a smaller model, or a larger device.")
        smaller = max(d for d in divisors(batch) if d <= m // 2)
        self.fitter.accumulation = batch // smaller
        return batch // smaller

    def _log(self, step: int, failed_at: list[tuple[int, list[int]]], k: int) -> None:
        old, new = failed_at[0][0], self.fitter.batch // k
        self.retries.append((step, old, new))
        if self.ctx.is_main:
            tried = ", ".join(f"{m} (out of memory on rank {listed(r)})" for m, r in failed_at)
            logger.info(f"--micro-batch auto: step {step} ran out of memory, micro-batch {old} -> {new}: retried with {new} sample(s) "
                        f"per micro-step x {k} accumulated = batch {self.fitter.batch}/process, kept from now on (tried {tried})")


def average_gradients(ctx: Any, model: Any, mine: float | None = None) -> torch.Tensor | None:
    """Every gradient averaged over the ranks, in buckets of ``BUCKET_BYTES`` (a parameter
    without one gets zeros, so every rank sends the same). With ``mine`` (this rank's status),
    every rank's status travels with the first bucket and comes back (summed: each rank's at its
    index); when any is not 0 the gradients are left as they were, for the caller to drop.
    Collective."""
    if not ctx.world.distributed:
        return None if mine is None else torch.tensor([mine])
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in (p.grad for p in params):
        nbytes = g.numel() * g.element_size()
        if buckets[-1] and (size + nbytes > BUCKET_BYTES or g.dtype != buckets[-1][0].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    flags = None
    if mine is not None:
        exact = buckets[0] and buckets[0][0].dtype in (torch.float32, torch.float64)  # small integers, summed exactly
        own = torch.zeros(ctx.world_size, dtype=buckets[0][0].dtype if exact else torch.float32, device=ctx.device)
        own[ctx.rank] = mine
        if not exact:
            flags = ctx.all_reduce(own, op="sum").cpu()
            if flags.any():
                return flags
    for i, bucket in enumerate(b for b in buckets if b):
        if i == 0 and mine is not None and flags is None:
            flat = ctx.all_reduce(torch.cat([own, _flatten_dense_tensors(bucket)]), op="sum")
            flags, flat = flat[:ctx.world_size].cpu(), flat[ctx.world_size:].div_(ctx.world_size)
            if flags.any():
                return flags
        else:
            flat = ctx.all_reduce(_flatten_dense_tensors(bucket), op="mean")
        for grad, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            grad.copy_(averaged)
    return flags


def _where(flags: torch.Tensor, *codes: int) -> list[int]:
    return [r for r in range(len(flags)) if int(flags[r]) in codes]
