"""``dtrain train --micro-batch auto``: the largest micro-batch per rank that fits the device
(docs/train.md says what users see).

Each rank's batch is split into micro-batches of ``m`` samples whose gradients accumulate, so the
global batch and the update stay the ones asked for: ``m`` changes memory, not training. ``m``
starts at the plan's proposal (``AutoMicro.proposal``) and is confirmed on the first batch by
*trials*: forward and backward of ``m`` samples with gradients kept local (``no_sync``: no
collective is left half done by a rank that failed), then every rank's out-of-memory flag in one
all-reduce, so all ranks take the same next ``m`` (``Search``). The trials commit nothing
(``Kept`` puts buffers and random states back), so no sample is skipped or seen twice. A later
out-of-memory is retried smaller (``train/microretry.py``). ``DTRAIN_OOM_INJECT`` (``Budget``)
makes a rank run out of memory on a CPU, to test this.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .._log import logger
from ..errors import ConfigError

AUTO = "auto"


@dataclass(frozen=True, kw_only=True)
class AutoMicro:
    """``--micro-batch auto`` as the workers receive it."""

    proposal: int | None = None
    """The first micro-batch to try: the largest the plan predicts to fit (None: the whole batch)."""
    reserve_bytes: float = 0.0
    """Optimizer state held during the trials while the optimizer has none yet (its first step
    allocates it; the plan's prediction of it)."""
    note: str = ""
    """How the proposal was made, for the log line."""

    def __post_init__(self) -> None:
        if self.proposal is not None and self.proposal < 1:
            raise ConfigError(f"--micro-batch auto: the proposal must be >= 1 sample, got {self.proposal}.")


def divisors(n: int) -> list[int]:
    """The micro-batches that split a batch of ``n`` evenly, smallest first."""
    return [d for d in range(1, n + 1) if n % d == 0]


def propose(batch: int, fits: Callable[[int], bool]) -> int | None:
    """The largest divisor ``m`` of ``batch`` with ``fits(m)``; None when not even one sample fits.
    ``fits`` is asked from the top down (memory grows with ``m``), so few predictions are made."""
    return next((m for m in reversed(divisors(batch)) if fits(m)), None)


@dataclass
class Search:
    """Which micro-batch to try next, from what the trials so far said (every rank alike)."""

    batch: int
    start: int
    tried: list[tuple[int, bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sizes = divisors(self.batch)
        self.start = max(m for m in self.sizes if m <= max(1, min(self.start, self.batch)))

    @property
    def best(self) -> int | None:
        """The largest micro-batch that fitted (None: none yet)."""
        return max((m for m, ok in self.tried if ok), default=None)

    @property
    def smallest_failed(self) -> int | None:
        return min((m for m, ok in self.tried if not ok), default=None)

    def next(self) -> int | None:
        """The micro-batch to try, or None when the search is over (``best`` is the answer;
        ``best`` None then means one sample did not fit)."""
        if not self.tried:
            return self.start
        good, bad = self.best, self.smallest_failed
        if good is None:  # nothing fitted yet: halve
            if bad == 1:
                return None
            return max(m for m in self.sizes if m <= bad // 2)
        lo = self.sizes.index(good)
        hi = self.sizes.index(bad) if bad is not None else len(self.sizes)
        if hi - lo <= 1:
            return None
        return self.sizes[(lo + hi) // 2]  # between them; up to the whole batch while none failed

    def record(self, m: int, fits: bool) -> None:
        self.tried.append((m, fits))


def settle(search: Search, trial: Callable[[int], bool]) -> int | None:
    """Run ``trial`` (True: fits on every rank) on ``search``'s picks until it is over; the largest
    micro-batch that fitted (None: not even one sample)."""
    while (m := search.next()) is not None:
        search.record(m, trial(m))
    return search.best


class Budget:
    """A fake device of ``limit`` bytes for one rank's trials (``DTRAIN_OOM_INJECT``): the
    parameters, their gradients and the reserve count from the start, then every tensor a forward
    saves for backward but a parameter; passing ``limit`` raises ``torch.OutOfMemoryError`` there, mid-forward,
    as an allocator would."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    @contextlib.contextmanager
    def watch(self, resident: float, params: set[int]) -> Iterator[None]:
        """``resident``: the bytes held from the start; ``params``: the ids of the parameters (counted
        in ``resident``, not again when saved)."""
        used = {"bytes": float(resident)}
        seen: set[int] = set(params)

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = t._base if t._base is not None else t
            if id(base) not in seen:
                seen.add(id(base))
                used["bytes"] += base.numel() * base.element_size()
                if used["bytes"] > self.limit:
                    raise torch.OutOfMemoryError(f"fake out of memory (DTRAIN_OOM_INJECT): {used['bytes']:.0f} bytes "
                                                 f"> {self.limit}")
            return t

        if resident > self.limit:
            raise torch.OutOfMemoryError(f"fake out of memory (DTRAIN_OOM_INJECT): {resident:.0f} bytes > {self.limit}")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield


def budget_for(rank: int, inject: tuple[int, int, int | None] | None, steps: bool = False) -> Budget | None:
    """This rank's fake device from ``DTRAIN_OOM_INJECT``'s (rank, bytes, from step): for the
    trials (``steps`` False) without a step, for the training micro-steps (``steps``) with one;
    None elsewhere."""
    if inject is None or inject[0] != rank or (inject[2] is not None) != steps:
        return None
    return Budget(inject[1])


def refuse_accum(grad_accum: int) -> None:
    """``--micro-batch auto`` with a ``--grad-accum`` of the user's: one line."""
    if grad_accum != 1:
        raise ConfigError(f"--micro-batch auto chooses the gradient accumulation itself (batch = micro-batch x accumulation), "
                          f"so --grad-accum {grad_accum} would be overridden; drop --grad-accum or --micro-batch auto.")


def refuse_strategy(capabilities: Any, strategy: str, comm: str | None = None) -> None:
    """One line for a strategy whose forward or step communicates, or a ``--comm`` method, before
    any trial."""
    if capabilities.collective_forward or capabilities.staged_step:
        # fsdp all-gathers each block's parameters in forward (tp exchanges activations, pp sends
        # between stages): a rank out of memory midway leaves the others in that collective, and
        # agreeing before each of them (a flag all-reduce per block) would cost more than it saves.
        raise ConfigError(f"--micro-batch auto retries a micro-step that ran out of memory, which strategy {strategy} cannot "
                          "do (its forward communicates, so a rank that failed would leave the others waiting); use ddp, "
                          "zero1 or single, or set --grad-accum yourself.")
    if comm not in (None, "none"):
        raise ConfigError(f"--micro-batch auto averages the gradients itself once every rank's micro-steps fitted, so --comm "
                          f"{comm} would not run; drop --comm or --micro-batch auto.")


class Fitter:
    """The search on this rank's first batch (``accum``), then the accumulation it settled on.

    Collective: every rank calls ``accum`` with its first batch, at the same point of the loop."""

    def __init__(self, ctx: Any, model: Any, optimizer: Any, loss_fn: Callable[[Any, Any], torch.Tensor], batch: int,
                 auto: AutoMicro, budget: Budget | None = None) -> None:
        self.ctx, self.model, self.optimizer, self.loss_fn = ctx, model, optimizer, loss_fn
        self.batch, self.auto, self.budget = batch, auto, budget
        self.accumulation: int | None = None
        self.search: Search | None = None
        self.failed_on: dict[int, list[int]] = {}
        self.seconds = 0.0

    def accum(self, x: Any, y: Any) -> int:
        """Micro-batches per batch: found on the first call (trials on ``x``, ``y``), kept after."""
        if self.accumulation is None:
            t0 = time.perf_counter()
            start = self._agreed(self.auto.proposal or self.batch)
            self.search = Search(self.batch, start)
            kept = Kept(self.model, self.ctx.device)
            try:
                m = settle(self.search, lambda m: self._trial(x, y, m))
            finally:
                kept.restore()
            self.seconds = time.perf_counter() - t0
            if m is None:
                raise ConfigError(f"--micro-batch auto: one sample per micro-step does not fit on {self.ctx.device} "
                                  f"(out of memory on rank(s) {listed(self.failed_on.get(1, []))}); the model alone is too "
                                  "large for it: shard it (--strategy fsdp), use a smaller model, or a larger device.")
            self.accumulation = self.batch // m
            if self.ctx.is_main:
                logger.info(self.line())
        return self.accumulation

    def line(self) -> str:
        """What the search found and what it tried, in one line."""
        assert self.search is not None and self.search.best is not None
        m = self.search.best
        tried = ", ".join(f"{s} ({'fits' if ok else 'out of memory on rank ' + listed(self.failed_on[s])})"
                          for s, ok in self.search.tried)
        note = f"; {self.auto.note}" if self.auto.note else ""
        return (f"--micro-batch auto: {m} sample(s) per micro-step x {self.batch // m} accumulated = batch {self.batch}/process "
                f"(tried {tried}, {self.seconds:.2f} s{note})")

    def record(self) -> dict[str, Any]:
        """The result record's fields (empty before the search)."""
        if self.search is None or self.search.best is None:
            return {}
        return {"micro_batch": self.search.best, "grad_accum": self.accumulation,
                "micro_batch_trials": [[m, ok] for m, ok in self.search.tried],
                "micro_batch_search_s": round(self.seconds, 3)}

    def _agreed(self, start: int) -> int:
        """The smallest proposal over the ranks (each may have planned for its own device), so
        every rank's trials go alike. Collective."""
        t = torch.tensor(float(start), dtype=torch.float64, device=self.ctx.device)
        return int(self.ctx.all_reduce(t, op="min").item())

    def _trial(self, x: Any, y: Any, m: int) -> bool:
        """Forward and backward of ``m`` samples on every rank; True when none ran out of memory.
        Collective: one all-reduce of a flag per rank (1: out of memory, 2: another error, which
        every rank then raises, so none is left waiting in the next trial's all-reduce)."""
        failed, error = torch.zeros(self.ctx.world_size, dtype=torch.float32), None
        try:
            self._run(x[:m], y[:m])
        except torch.OutOfMemoryError:  # the frames that held the activations are gone with the exception
            failed[self.ctx.rank] = 1.0
        except Exception as exc:  # noqa: BLE001 - agreed first, raised below
            failed[self.ctx.rank], error = 2.0, exc
        for p in self.model.parameters():
            p.grad = None
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()  # what the failed trial cached goes back before the next one
        failed = self.ctx.all_reduce(failed.to(self.ctx.device), op="sum").cpu()
        if error is not None:
            raise error
        broken = [r for r in range(self.ctx.world_size) if failed[r] > 1]
        if broken:
            raise ConfigError(f"--micro-batch auto: the trial of {m} sample(s) per micro-step failed on rank(s) {listed(broken)} "
                              "with an error other than out-of-memory (that rank's error says which).")
        self.failed_on[m] = [r for r in range(self.ctx.world_size) if failed[r] > 0]
        return not self.failed_on[m]

    def _run(self, xm: Any, ym: Any) -> None:
        from ..context.step import inner_module

        reserve = 0.0 if len(self.optimizer.state) else self.auto.reserve_bytes
        held = torch.empty(int(reserve), dtype=torch.uint8, device=self.ctx.device) if reserve and self.ctx.device.type == "cuda" else None
        params = list(self.model.parameters())
        resident = 2 * sum(p.numel() * p.element_size() for p in params) + reserve
        watch = self.budget.watch(resident, {id(p) for p in params}) if self.budget is not None else contextlib.nullcontext()
        try:
            with self.ctx.strategy.no_sync(inner_module(self.model)), watch:
                self.loss_fn(self.model(xm), ym).backward()
        finally:
            del held


class Kept:
    """What trial forwards change, put back by ``restore``: buffers (BatchNorm's running statistics)
    and the random states (dropout), so the step that follows is the one a run without them takes."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def listed(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) or "none"
