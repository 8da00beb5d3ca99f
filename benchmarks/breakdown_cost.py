"""The default-on step breakdown's cost on MNIST, as a ratio inside one run: the same 2 processes
train in blocks of steps, alternately with the breakdown on (every lap timed, the compute-end
callback queued in each backward, and the per-interval all_gather of every rank's window that
feeds the straggler detector) and off (``ctx.breakdown.enabled = False``: each mark returns at
once; only the data wait, which the result record always had, is timed), in ABBA order so a
drifting machine load favours neither side.

    dtrain run -n 2 benchmarks/breakdown_cost.py --data-dir ../shared/data/mnist --blocks 16 --steps 20
    dtrain run -n 2 benchmarks/breakdown_cost.py --data-dir ../shared/data/mnist --blocks 16 --steps 20 --per-step
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader

import dtrain
from dtrain.metrics.stragglers import StragglerConfig
from dtrain.tasks import load_task
from dtrain.train.observe import Observer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--blocks", type=int, default=16, help="blocks of steps, half with the breakdown on (ABBA order)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per block (one log interval: one all_gather when on)")
    p.add_argument("--per-step", action="store_true",
                   help="alternate on and off every step (ABBA) for blocks x steps steps; compare median and mean step times")
    args = p.parse_args()

    ctx = dtrain.init("ddp", seed=0)
    task = load_task("mnist", data_dir=args.data_dir)
    model = task.build_model()
    opt = torch.optim.Adadelta(model.parameters(), lr=task.lr)
    model, opt = ctx.setup(model, opt)
    loader = ctx.setup_dataloader(DataLoader(task.train_set, batch_size=task.batch_size, shuffle=True))
    obs = Observer(ctx, model, opt, StragglerConfig())
    bd = ctx.breakdown
    batches = iter(loader)

    def run_block(on: bool) -> float:
        nonlocal batches
        bd.enabled = on
        ctx.barrier()
        t0 = time.perf_counter()
        bd.step_starts()
        for _ in range(args.steps):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            bd.got_batch()
            ctx.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            bd.step_starts()
        obs.interval(0)  # on: the window's all_gather and the detector; off: nothing
        ctx.barrier()
        return time.perf_counter() - t0

    mark_us = marks_cost_us(ctx)
    gather_us = interval_cost_us(ctx, obs)
    ctx.print(f"direct costs: the marks of one step {mark_us:.1f} us; one log interval's all_gather and detector "
              f"{gather_us:.0f} us (once per --log-every steps, default 20)")
    if args.per_step:
        per_step(ctx, args, model, opt, loader, obs, task, mark_us)
        return
    run_block(True)  # warm-up
    on, off = [], []
    for i in range(args.blocks):
        side_on = i % 4 in (0, 3)  # ABBA
        (on if side_on else off).append(run_block(side_on))
    pairs = [o / n for o, n in zip(off, on)]  # samples/s on / off = time off / time on, block by block
    sps = lambda t: args.steps * task.batch_size * ctx.world_size / t  # noqa: E731
    ctx.print(f"MNIST, {ctx.world_size} ranks, {args.blocks} blocks of {args.steps} steps (ABBA): breakdown on "
              f"{statistics.median(sps(t) for t in on):.1f} samples/s, off {statistics.median(sps(t) for t in off):.1f}; "
              f"on/off median of paired ratios {statistics.median(pairs):.4f} (min {min(pairs):.3f}, max {max(pairs):.3f}); "
              f"the marks of one step alone cost {mark_us:.1f} us (median step on: {statistics.median(on) / args.steps * 1e3:.2f} ms)")
    obs.close()
    ctx.close()


def per_step(ctx, args, model, opt, loader, obs, task, mark_us: float) -> None:  # noqa: ANN001
    """On and off alternate step by step (ABBA), so both sides see the same machine load; the on
    side also pays one all_gather of the window every ``args.steps`` of its steps."""
    bd = ctx.breakdown
    batches = iter(loader)
    times: dict[bool, list[float]] = {True: [], False: []}
    ctx.barrier()
    for i in range(args.blocks * args.steps * 2 + 4):
        on = i % 4 in (0, 3)
        bd.enabled = on
        t0 = time.perf_counter()
        bd.step_starts()
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        bd.got_batch()
        ctx.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
        if on and len(times[True]) % args.steps == args.steps - 1:
            bd.enabled = True
            obs.interval(0)  # every rank's on-count is the same: the all_gather lines up
        bd.finish()
        if i >= 4:  # warm-up
            times[on].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    mean = {k: statistics.fmean(v) * 1e3 for k, v in times.items()}
    ctx.print(f"MNIST, {ctx.world_size} ranks, {len(times[True])} steps per side alternating ABBA step by step: "
              f"median step on {med[True]:.3f} ms, off {med[False]:.3f} ms (on/off {med[True] / med[False]:.4f}); "
              f"mean on {mean[True]:.3f} ms, off {mean[False]:.3f} ms (on/off {mean[True] / mean[False]:.4f}); "
              f"the marks of one step alone cost {mark_us:.1f} us")
    obs.close()
    ctx.close()


def interval_cost_us(ctx: dtrain.Context, obs: Observer, n: int = 200) -> float:
    """The per-interval part: ``obs.interval`` with the breakdown on (reads the window, one
    all_gather of every rank's figures, the detector on rank 0) against off (returns at once),
    alternating, median difference in microseconds. A barrier before each call keeps the ranks
    in step, so the all_gather does not also time one rank waiting for the other."""
    bd = ctx.breakdown
    diffs = []
    for _ in range(n):
        t = {}
        for on in (True, False):
            bd.enabled = on
            ctx.barrier()
            t0 = time.perf_counter()
            obs.interval(0)
            t[on] = time.perf_counter() - t0
        diffs.append((t[True] - t[False]) * 1e6)
    return statistics.median(diffs)


def marks_cost_us(ctx: dtrain.Context, n: int = 2000) -> float:
    """The breakdown's own cost per step, without the noise of training: a step of marks around a
    one-element backward, on against off (alternating), median difference in microseconds."""
    w = torch.ones(1, requires_grad=True)
    bd = ctx.breakdown

    def once(on: bool) -> float:
        bd.enabled = on
        t0 = time.perf_counter()
        bd.step_starts()
        bd.got_batch()
        loss = (w * 2).sum()
        bd.backward_starts(loss)
        loss.backward()
        bd.backward_done()
        bd.lap("rest")
        bd.lap("optimizer")
        bd.step_starts()
        return time.perf_counter() - t0

    diffs = [(once(True) - once(False)) * 1e6 for _ in range(n)]
    bd.window()  # drop these steps
    return statistics.median(diffs)


if __name__ == "__main__":
    main()
