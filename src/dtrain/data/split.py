"""How one global batch is split between ranks (``dtrain train --batch-split``): evenly (the
default), in fixed shares (``--batch-split 40,24``) or by each rank's measured speed
(``--batch-split speed``).

A slower rank (another GPU model, a busy host, a throttled card) holds every rank at its pace
in each step's gradient all-reduce. Giving it fewer samples of the same global batch lets the
ranks finish their compute together. Three things keep training the same as the even split's:

- the global batch ``G`` is unchanged, and each step trains on the same ``G`` samples of the
  epoch's order as the even split's step does, only handed out differently (``split_sampler.py``);
- every rank gets at least one *unit* (``G`` / units, a whole number of samples per
  micro-batch for ``--grad-accum``: a share is a multiple of the accumulation steps, so each
  rank's micro-batches stay equal and every rank runs the same number of them);
- each rank's loss is weighted (``loss_weight``) so that the averaged gradient is the mean
  over the global batch, exactly: DDP, zero1 and FSDP average the ranks' gradients, which
  weights a rank's *mean* loss by ``1/W`` whatever its sample count; weighting a micro-batch of
  ``m`` samples by ``m * k * W / G`` (``k`` accumulation steps, ``W`` ranks) makes each sample
  count ``1/G``. With an even split the weight is exactly 1.

The speed split (``shares_for``) minimises the slowest rank's predicted compute time
``fixed_r + n_r * per_sample_r`` over whole units (water filling, one unit at a time to the rank
that would finish first: optimal for costs that grow linearly in the samples).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError

MODES = ("even", "speed")


@dataclass(frozen=True)
class SplitSpec:
    """What ``--batch-split`` asks for: ``even``, ``speed`` or fixed ``shares`` (one per rank)."""

    mode: str = "even"
    shares: tuple[int, ...] | None = None

    @classmethod
    def parse(cls, text: str) -> SplitSpec:
        text = str(text).strip().lower()
        if text in MODES:
            return cls(mode=text)
        parts = [p.strip() for p in text.split(",")]
        if len(parts) < 2 or not all(p.isdigit() for p in parts):
            raise ConfigError(f"--batch-split {text!r} is not even, speed or samples per rank; give e.g. --batch-split speed "
                              "or --batch-split 40,24 (whole samples per rank, summing to the global batch).")
        shares = tuple(int(p) for p in parts)
        if 0 in shares:
            raise ConfigError(f"--batch-split {text}: rank {shares.index(0)} would get zero samples; give every rank at "
                              "least one sample (its micro-batches for --grad-accum), e.g. --batch-split speed.")
        return cls(mode="fixed", shares=shares)

    def __str__(self) -> str:
        return ",".join(map(str, self.shares)) if self.shares else self.mode


def even_shares(global_batch: int, world_size: int) -> list[int]:
    """``global_batch`` in ``world_size`` equal shares (the even split; it divides)."""
    return [global_batch // world_size] * world_size


def check_shares(shares: Sequence[int], *, global_batch: int, world_size: int, unit: int) -> list[int]:
    """Fixed shares (``--batch-split 40,24``) checked against the job: one per rank, each a
    positive multiple of ``unit`` (the accumulation steps), summing to the global batch."""
    given = ",".join(map(str, shares))
    if len(shares) != world_size:
        raise ConfigError(f"--batch-split {given} gives {len(shares)} shares but the job has {world_size} processes; "
                          f"give one share per process, or --batch-split speed.")
    if sum(shares) != global_batch:
        raise ConfigError(f"--batch-split {given} sums to {sum(shares)} samples, not the global batch {global_batch} "
                          f"(--batch-size x {world_size} processes); make the shares sum to {global_batch}.")
    odd = [s for s in shares if s < unit or s % unit]
    if odd:
        raise ConfigError(f"--batch-split {given}: share {odd[0]} is not a positive multiple of --grad-accum {unit} "
                          f"(each rank splits its share into {unit} equal micro-batches); round the shares to multiples of {unit}.")
    return list(shares)


def shares_for(global_batch: int, per_sample_ms: Sequence[float], fixed_ms: Sequence[float], *, unit: int = 1,
               least: int = 1) -> list[int]:
    """Samples per rank that minimise the slowest rank's ``fixed_ms[r] + n * per_sample_ms[r]``:
    multiples of ``unit``, each at least ``least`` units (one where the batch has too few for
    that), summing to ``global_batch`` (a multiple of ``unit``). Deterministic: the same figures
    give the same shares on every rank."""
    world = len(per_sample_ms)
    units = global_batch // unit
    if global_batch % unit or units < world:
        raise ConfigError(f"a global batch of {global_batch} samples cannot give {world} ranks {unit} sample(s) each "
                          f"in whole micro-batches; raise --batch-size.")
    bad = [r for r in range(world) if not (math.isfinite(per_sample_ms[r]) and per_sample_ms[r] > 0 and math.isfinite(fixed_ms[r]))]
    if bad:
        raise ValueError(f"no usable rate for rank(s) {bad}")  # the caller keeps the split it has
    least = least if units >= least * world else 1
    counts = [least] * world
    # The heap holds each rank's finish time were it given one more unit; ties go to the lower rank.
    heap = [(fixed_ms[r] + (least + 1) * unit * per_sample_ms[r], r) for r in range(world)]
    heapq.heapify(heap)
    for _ in range(units - least * world):
        _, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (fixed_ms[r] + (counts[r] + 1) * unit * per_sample_ms[r], r))
    return [c * unit for c in counts]


def predicted_ms(shares: Sequence[int], per_sample_ms: Sequence[float], fixed_ms: Sequence[float]) -> float:
    """The slowest rank's predicted compute time (ms) with ``shares``."""
    return max(f + n * c for n, c, f in zip(shares, per_sample_ms, fixed_ms))


def loss_weight(samples: int, accumulation_steps: int, world_size: int, global_batch: int) -> float:
    """The factor on a micro-batch's mean loss that makes each of its ``samples`` count
    ``1/global_batch`` in the gradient the ranks average (see the module's docstring)."""
    return samples * accumulation_steps * world_size / global_batch


def weighted(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], accumulation_steps: Callable[[], int], *,
             world_size: int, global_batch: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss_fn`` (a mean over the batch's samples, as every built-in task's) weighted by
    ``loss_weight`` for the micro-batch it is called on (its sample count: ``len(target)``)."""
    def loss(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(outputs, target) * loss_weight(len(target), accumulation_steps(), world_size, global_batch)

    loss.__name__ = getattr(loss_fn, "__name__", "loss")
    return loss


class SplitSchedule:
    """Which shares hold from which step on: ``[(from_step, shares), ...]``, the newest last.
    The sampler reads it as it builds each step's batch; a change is added for a step that no
    rank's sampler has built yet, so every rank switches at the same step."""

    def __init__(self, shares: Sequence[int]) -> None:
        self.entries: list[tuple[int, list[int]]] = [(0, list(shares))]

    def at(self, step: int) -> list[int]:
        """The shares of the step numbered ``step`` (1 is the first step)."""
        current = self.entries[0][1]
        for start, shares in self.entries:
            if start > step:
                break
            current = shares
        return current

    @property
    def last(self) -> list[int]:
        return self.entries[-1][1]

    def change(self, from_step: int, shares: Sequence[int]) -> None:
        assert from_step >= self.entries[-1][0]  # our own misuse: changes come in order
        self.entries.append((int(from_step), list(shares)))

    def state(self) -> list[list]:
        return [[start, list(shares)] for start, shares in self.entries]

    @classmethod
    def from_state(cls, entries: list) -> SplitSchedule:
        out = cls(entries[0][1])
        out.entries = [(int(s), [int(n) for n in shares]) for s, shares in entries]
        return out


def describe(shares: Sequence[int]) -> str:
    """``40/24`` samples per rank."""
    return "/".join(map(str, shares))


DRIFT_ENTER = 1.2
"""A window whose slowest rank's own compute is this many times the fastest's has drifted
(either way: a rank slower, or one faster that now waits for the others) and is re-measured."""
DRIFT_REARM = 1.1
"""After a re-measure, the gate fires again only once a window has been within this: the new split's
balance is seen before a moderate drift may change it, so noise around the threshold (a split that
the one-point model cannot balance better) does not swing the split back and forth."""


class DriftGate:
    """When a measured split is re-measured for a moderate drift (hysteresis on the spread of the
    ranks' own compute times). A spread is ``max / min``: a rank that got faster by 1 / 1.2 shows
    as 1.2 though no rank is 1.3x the others' median (the straggler detector's rule). Pure logic."""

    def __init__(self, enter: float = DRIFT_ENTER, rearm: float = DRIFT_REARM) -> None:
        assert 1.0 <= rearm < enter  # our own constants
        self.enter, self.rearm = enter, rearm
        self.armed = True
        """Armed from the start: a first split (or its refinement) that left the ranks 1.2x apart
        is corrected once by the drift check's measurement."""

    def spread(self, own_ms: Sequence[float]) -> float:
        return max(own_ms) / min(own_ms) if min(own_ms) > 0 else math.inf

    def fires(self, own_ms: Sequence[float]) -> float | None:
        """The spread of this window's own compute times (ms per rank) if it calls for a
        re-measure, else None; a balanced window arms the gate."""
        spread = self.spread(own_ms)
        if spread <= self.rearm:
            self.armed = True
        return spread if self.armed and spread >= self.enter and math.isfinite(spread) else None

    def changed(self) -> None:
        """A drift was re-measured (the split changed or kept): wait for a balanced window before the next."""
        self.armed = False
