"""The batch split by rank speed as a listener (``--batch-split speed``; ``dtrain.data.split``);
docs/train.md says what users see.

After the warm-up, every rank's step breakdown is gathered (one small all_gather) and the global
batch split so the slowest rank's predicted time is least (``split.shares_for``), from a step no
rank's sampler has built yet. One batch size cannot tell per-sample cost from the part that does
not shrink with the batch, so ``REFINE_ROWS`` steps later each rank's compute is fitted as a line
through two points (``fit_line``) and the split made again; ``REFINE_ROWS`` steps after a change
the refined split's measured step is compared with the one it replaced, and the faster kept
(the fit is from noisy medians). Then every ``--straggler-window``
steps a straggler detector, or a compute spread past ``split.DriftGate``, re-measures the split.
``--batch-split 40,24`` fixes the shares; a checkpoint keeps the schedule.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..._log import logger
from ...data.split import DriftGate, SplitSpec, check_shares, describe, predicted_ms, shares_for, weighted
from ...data.split_sampler import SplitLoader, split_loader
from ...errors import ConfigError
from ...metrics.breakdown import pack, unpack
from ...metrics.stragglers import StragglerConfig, StragglerDetector
from . import Listener, LoopState

MEASURE_STEPS = 4
"""The split is first measured after this many steps (or the warm-up's, if more), the first
step apart (it starts the loader)."""
MIN_GAIN = 0.03
"""A re-measured split replaces the current one only if it shortens the predicted step by this share."""
REFINE_ROWS = 6
"""Steps with the first measured split whose figures, with the first measurement's, fit each rank's line."""
LEAST = 2
"""Samples per micro-batch a measured split leaves every rank (where the batch has that many):
BatchNorm in training refuses a batch of one sample at a 1x1 feature map (ResNet's last block)."""
CONFIRM_SLACK = 0.01
"""A refined split is kept unless its measured step is longer than the replaced split's by more than this share."""
PER_SAMPLE = ("forward", "backward", "data_wait")
FIXED = ("optimizer", "rest")


def attach(ctx: Any, cfg: Any, task: Any, loader: Any, batch: int) -> tuple[Any, Any, BatchSplit | None]:
    """For ``--batch-split`` other than even: the loader that splits the global batch, the task
    whose loss is weighted for it, and the listener that measures; (loader, task, None) for even.
    A combination that cannot take uneven batches is a ConfigError (every rank, before training)."""
    spec = SplitSpec.parse(cfg.batch.split)
    if spec.mode == "even":
        return loader, task, None
    world = ctx.data_parallel_size
    refuse(ctx, spec, world, breakdown=cfg.observe.breakdown)
    k, global_batch = cfg.batch.grad_accum, batch * world
    shares = check_shares(spec.shares, global_batch=global_batch, world_size=world, unit=k) if spec.shares else None
    if world == 1:
        return loader, task, None  # one rank takes the whole batch: nothing to split
    if global_batch // k < world:  # never with divisible batches, but a rank must get a micro-batch
        raise ConfigError(f"--batch-split {spec}: a global batch of {global_batch} cannot give each of {world} ranks "
                          f"{k} micro-batch(es) of a sample; raise --batch-size.")
    split = split_loader(loader, shares)
    task = dataclasses.replace(task, loss_fn=weighted(task.loss_fn, lambda: ctx.accumulation_steps, world_size=world,
                                                     global_batch=global_batch))
    measure = spec.mode == "speed"
    listener = BatchSplit(ctx, split, measure=measure, unit=k, warmup_steps=cfg.observe.warmup_steps,
                          stragglers=cfg.observe.stragglers)
    if ctx.is_main:
        how = "by speed: even until measured" if measure else f"fixed {describe(shares)}"
        logger.info(f"batch split {how}; global batch {global_batch} over {world} ranks")
    return split, task, listener


def refuse(ctx: Any, spec: SplitSpec, world: int, *, breakdown: bool) -> None:
    """One line for a combination whose ranks cannot take batches of different sizes."""
    strategy = ctx.strategy
    if strategy.capabilities.staged_step or world != ctx.world_size:
        raise ConfigError(f"--batch-split {spec} needs every rank to read its own batch, but strategy {strategy.name!r} "
                          f"has {world} data-parallel replica(s) on {ctx.world_size} processes (pipeline stages or tensor "
                          "parallel ranks share a batch); use ddp, zero1, fsdp, hsdp or hvd, or drop --batch-split.")
    comm = str(strategy.comm_record().get("comm") or "none")
    if comm.startswith(("localsgd", "auto")):
        raise ConfigError(f"--batch-split {spec} with --comm {comm}: local SGD averages parameters, not gradients, so "
                          "uneven batches would change training; use --comm none, fp16, bf16 or powersgd, or drop --batch-split.")
    if spec.mode == "speed" and not breakdown:
        raise ConfigError("--batch-split speed measures each rank with the step breakdown; drop --no-breakdown "
                          "(or fix the shares: --batch-split 40,24).")


class BatchSplit(Listener):
    """Starts the loader's step count; with ``measure``, splits by speed after warm-up and
    again when a straggler is named. Collective (the measurements): every rank, same steps."""

    def __init__(self, ctx: Any, loader: SplitLoader, *, measure: bool, unit: int, warmup_steps: int | None,
                 stragglers: StragglerConfig) -> None:
        self.ctx, self.loader, self.measure, self.unit = ctx, loader, measure, unit
        self.first_rows = max(MEASURE_STEPS, warmup_steps or 0)
        self.window = stragglers.window
        # One host name for every rank: the detector never asks for a link probe here.
        self.detector = StragglerDetector(stragglers, ["-"] * loader.world_size)
        self.gate = DriftGate()  # moderate drifts either way, which the detector's 1.3x does not name
        self.next_check: int | None = None
        self.measured = False
        """The first measurement was made (or a checkpoint's split continues)."""
        self.changes: list[dict[str, Any]] = []
        """Every change of shares: step measured, from step, old and new shares, why."""
        self.refine_at: int | None = None
        """The step at which the first split's figures are read for the two-point fit (pending)."""
        self.first_point: tuple[list[int], list[float]] | None = None
        """The first measurement's shares and each rank's compute ms (the line's first point)."""
        self.confirm: tuple[int, list[int], list[int], float] | None = None
        """A refinement to check by measurement (pending): at which step, the refined shares, the shares
        they replaced and those shares' measured step (ms)."""

    def settled(self, step: int) -> bool:
        """Measured, refined, and the last change in use from the step after ``step``."""
        return self.measured and self.refine_at is None and self.confirm is None and (not self.changes or step + 1 >= self.changes[-1]["from_step"])

    def on_start(self, state: LoopState) -> None:
        self.loader.start_step(state.step)
        if not self.measure:
            return
        self.measured = self.loader.restored  # the checkpoint's split continues; only drift changes it
        if self.measured:
            self.next_check = state.step + self.window + 1
        else:
            self.next_check = state.step + self.first_rows + 1

    def on_step(self, state: LoopState) -> None:
        if self.refine_at is not None and state.step == self.refine_at:
            self.refine_at = None
            self._refine(state.step)
        elif self.confirm is not None and state.step == self.confirm[0]:
            self._confirm(state.step)
        else:
            self._due_check(state)
            return
        if self.next_check is not None and self.next_check <= state.step:  # a window shorter than the refinement's
            self.next_check = state.step + self.window

    def _due_check(self, state: LoopState) -> None:
        """The first measurement, or a drift check, where this step is the one due."""
        if self.next_check is None or state.step != self.next_check:
            return
        first = not self.measured
        self.measured = True
        # The breakdown's row of a step closes as the next starts: the rows closed now are
        # steps up to state.step - 1; the first measurement leaves out the run's first step.
        rows = self.first_rows - 1 if first else self.window
        self._check(state.step, rows, first)

    def _gather(self, rows: int) -> tuple[list[dict[str, Any] | None], int]:
        """Every rank's breakdown over its last ``rows`` steps, and the first step no rank's
        sampler has built (DataLoader workers build ahead). Collective: every rank."""
        window = self.ctx.breakdown.recent(rows)
        t = torch.tensor([*pack(window), float(self.loader.batch_sampler.next_step)], dtype=torch.float64, device=self.ctx.device)
        gathered = [g.tolist() for g in self.ctx.all_gather(t)]
        return [unpack(g[:-1]) for g in gathered], int(max(g[-1] for g in gathered))

    def _check(self, step: int, rows: int, first: bool) -> None:
        per_rank, from_step = self._gather(rows)
        current = self.loader.schedule.at(step - 1)  # every measured step ran with these (see on_step)
        self.next_check = step + self.window
        found = [] if first else self.detector.add(step, per_rank)
        own = None if first or None in per_rank else [sum(w["median_ms"].get(p) or 0.0 for p in (*PER_SAMPLE, *FIXED)) for w in per_rank]
        spread = self.gate.fires(own) if own else None  # fed every window: a balanced one arms it
        if not first and not found and spread is None:
            return
        if not first:  # changed or kept, this drift was acted on: the next moderate one waits for a balanced window
            self.gate.changed()
        try:
            per_sample, fixed = costs(per_rank, current)
            new = shares_for(sum(current), per_sample, fixed, unit=self.unit, least=LEAST)
        except ValueError:  # a rank without figures (no step closed): keep the split
            if self.ctx.is_main:
                logger.warning(f"batch split: no step breakdown from every rank at step {step}; the split stays {describe(current)}")
            return
        rates = ", ".join(f"rank {r} {1e3 / c:.4g}" for r, c in enumerate(per_sample))
        why = "measured after warm-up" if first else "re-measured: " + "; ".join(
            f"rank {f['rank']}'s own step was {f['ratio']:.2f}x the others' ({f['cause']})" for f in found)
        if not first and not found:
            why += f"the ranks' own compute drifted {spread:.2f}x apart (slowest / fastest)"
        if new == current or (not first and predicted_ms(new, per_sample, fixed) > (1 - MIN_GAIN) * predicted_ms(current, per_sample, fixed)):
            if self.ctx.is_main:  # said once a measurement: the split it keeps, and why
                logger.info(f"batch split: {why} at step {step}: shares stay {describe(current)} samples per rank "
                            f"(compute samples/s: {rates})")
            return
        self._change(step, from_step, current, new, why, f"compute samples/s: {rates}")
        if first:  # the line's first point; the second comes from the new split's steps
            self.first_point = (current, [c * n for c, n in zip(per_sample, current)])
            self.refine_at = from_step + REFINE_ROWS

    def _change(self, step: int, from_step: int, current: list[int], new: list[int], why: str, figures: str) -> None:
        self.loader.schedule.change(from_step, new)
        self.next_check = from_step + self.window
        self.changes.append({"step": step, "from_step": from_step, "old": current, "new": new, "why": why})
        if self.ctx.is_main:
            logger.info(f"batch split: {why} at step {step}: shares {describe(current)} -> {describe(new)} samples per rank "
                        f"from step {from_step} ({figures})")

    def _refine(self, step: int) -> None:
        """The two-point fit: the first split's last ``REFINE_ROWS`` steps (every one ran with it)
        and the first measurement give each rank a line; the split is made again from the lines."""
        per_rank, from_step = self._gather(REFINE_ROWS)
        current = self.loader.schedule.at(step - 1)
        (n1, t1), self.first_point = self.first_point, None
        try:
            per_sample, fixed = costs(per_rank, current)
        except ValueError:
            return  # a rank without figures: the first split stays
        lines = [fit_line(a, ta, b, c * b) for a, ta, b, c in zip(n1, t1, current, per_sample)]
        per_sample = [slope for _, slope in lines]
        fixed = [f + cut for f, (cut, _) in zip(fixed, lines)]
        new = shares_for(sum(current), per_sample, fixed, unit=self.unit, least=LEAST)
        figures = "compute per rank: " + ", ".join(f"rank {r} {f:.4g} ms + {c:.4g} ms/sample" for r, (f, c) in enumerate(zip(fixed, per_sample)))
        if new == current or predicted_ms(new, per_sample, fixed) > (1 - MIN_GAIN) * predicted_ms(current, per_sample, fixed):
            if self.ctx.is_main:
                logger.info(f"batch split: refined with a second point at step {step}: shares stay {describe(current)} ({figures})")
            return
        self._change(step, from_step, current, new, "refined with a second point", figures)
        before = slowest_step(per_rank)
        if before is not None:  # the lines come from noisy medians: the new split's own steps say whether it is faster
            self.confirm = (from_step + REFINE_ROWS, new, current, before)

    def _confirm(self, step: int) -> None:
        """The refined split's last ``REFINE_ROWS`` steps against the split it replaced: back to
        that one where the refined split measured slower. Collective: every rank, same step."""
        per_rank, from_step = self._gather(REFINE_ROWS)
        (_, refined, before, before_ms), self.confirm = self.confirm, None
        after_ms, current = slowest_step(per_rank), self.loader.schedule.at(step - 1)
        if current != refined or after_ms is None or after_ms <= (1 + CONFIRM_SLACK) * before_ms:
            return  # kept (or a drift check, with a window shorter than REFINE_ROWS, changed it meanwhile)
        self._change(step, from_step, current, before, "the refined split measured slower",
                     f"step {after_ms:.4g} ms against {before_ms:.4g} ms with {describe(before)}")


def fit_line(n1: int, t1: float, n2: int, t2: float) -> tuple[float, float]:
    """(fixed ms, ms per sample) of the line through one rank's two (samples, compute ms) points;
    where the points give no usable line (same shares, noise making a slope or intercept
    negative) the later point alone, all per sample."""
    if n1 != n2:
        slope = (t2 - t1) / (n2 - n1)
        cut = t2 - slope * n2
        if slope > 0 and cut >= 0:
            return cut, slope
    return 0.0, t2 / n2


def slowest_step(per_rank: list[dict[str, Any] | None]) -> float | None:
    """The longest of the ranks' median step times (ms, with exposed communication): the step
    every rank runs at; None where a rank has no figure."""
    steps = [(w or {}).get("median_ms", {}).get("step") for w in per_rank]
    return None if None in steps else max(steps)


def costs(per_rank: list[dict[str, Any] | None], shares: list[int]) -> tuple[list[float], list[float]]:
    """Each rank's compute ms per sample (forward, backward, data wait over its samples) and
    fixed ms per step (optimizer, the rest); ValueError where a rank has no figures."""
    per_sample, fixed = [], []
    for window, n in zip(per_rank, shares):
        if window is None or any(window["median_ms"].get(p) is None for p in (*PER_SAMPLE, *FIXED)):
            raise ValueError("a rank has no breakdown")
        med = window["median_ms"]
        per_sample.append(sum(med[p] for p in PER_SAMPLE) / n)
        fixed.append(sum(med[p] for p in FIXED))
    return per_sample, fixed
