"""The stall watchdog's cost per step on MNIST, as a ratio inside one run: the same 2 processes
train in blocks of steps, alternately with the watchdog on (its thread polling the store, the
heartbeats and the collective ring buffer) and fully off (the bookkeeping replaced by no-ops),
in ABBA order so a drifting machine load favours neither side. Separate runs per side (as
``watchdog.py`` does) vary by 10% or more on a shared machine; blocks of one run share it.

    dtrain run -n 2 --stall-timeout 0 benchmarks/watchdog_step_cost.py --data-dir ../shared/data/mnist --blocks 16 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader

import dtrain
from dtrain.diag import Watchdog
from dtrain.tasks import load_task


class NoBookkeeping:
    """A Tracker that records nothing: the "off" side."""

    step, armed, current = 0, False, None

    def beat(self, step: int | None = None) -> None:
        pass

    def enter(self, op, *tensors):  # noqa: ANN001, ANN201
        return None

    def leave(self, call) -> None:  # noqa: ANN001
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--blocks", type=int, default=16, help="blocks of steps, half with the watchdog on (ABBA order)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per block")
    args = p.parse_args()

    ctx = dtrain.init("ddp", seed=0, stall_timeout=0)  # the benchmark starts and stops the watchdog itself
    task = load_task("mnist", data_dir=args.data_dir)
    model = task.build_model()
    opt = torch.optim.Adadelta(model.parameters(), lr=task.lr)
    model, opt = ctx.setup(model, opt)
    loader = ctx.setup_dataloader(DataLoader(task.train_set, batch_size=task.batch_size, shuffle=True))
    real = ctx.tracker
    batches = iter(loader)

    def run_block(on: bool) -> float:
        nonlocal batches
        tracker = real if on else NoBookkeeping()
        ctx.tracker, loader._on_batch = tracker, tracker.beat
        dog = Watchdog(real, rank=ctx.rank, size=ctx.world_size, timeout_s=900, run_dir="/tmp", master_addr=ctx.world.master_addr,
                       master_port=ctx.world.master_port).start() if on else None
        ctx.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            ctx.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        ctx.barrier()
        elapsed = time.perf_counter() - t0
        if dog is not None:
            dog.stop()
        return elapsed

    run_block(True)  # warm-up
    on, off = [], []
    for i in range(args.blocks):
        side_on = i % 4 in (0, 3)  # ABBA
        (on if side_on else off).append(run_block(side_on))
    ctx.tracker = real
    pairs = [o / n for o, n in zip(off, on)]  # samples/s on / off = time off / time on, block by block
    sps = lambda t: args.steps * task.batch_size * ctx.world_size / t  # noqa: E731
    ctx.print(f"MNIST, {ctx.world_size} ranks, {args.blocks} blocks of {args.steps} steps (ABBA): watchdog on "
              f"{statistics.median(sps(t) for t in on):.1f} samples/s, off {statistics.median(sps(t) for t in off):.1f}; "
              f"on/off median of paired ratios {statistics.median(pairs):.4f} (min {min(pairs):.3f}, max {max(pairs):.3f})")
    ctx.close()


if __name__ == "__main__":
    main()
