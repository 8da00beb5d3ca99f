"""Checkpoint save time of a ~100 M-parameter model with Adam state on CPU: a synchronous save
against the blocking part of an asynchronous one (copy to host memory; the write runs in a
background thread; from the second save on, into the host buffers of the previous one).
Alternates the two, R rounds, and reports medians.

    python benchmarks/checkpoint_save.py --rounds 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

import dtrain


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=6)
    args = p.parse_args()
    torch.manual_seed(0)
    ctx = dtrain.init("single")
    net = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    model, opt = ctx.setup(net, opt)
    model(torch.randn(2, args.width)).sum().backward()
    opt.step()  # Adam's state (exp_avg, exp_avg_sq) now exists
    params = sum(p.numel() for p in net.parameters())
    folder = tempfile.mkdtemp(prefix="dtrain-ckpt-bench-")
    sync_ckpt = ctx.checkpoints(f"{folder}/sync", keep=1)
    async_ckpt = ctx.checkpoints(f"{folder}/async", keep=1, async_save=True)
    sync_s, block_s, async_total_s = [], [], []
    step = 0
    for _ in range(args.rounds):
        step += 1
        t0 = time.perf_counter()
        sync_ckpt.save(step, model=model, optimizer=opt)
        sync_s.append(time.perf_counter() - t0)
        async_ckpt.save(step, model=model, optimizer=opt)
        block_s.append(async_ckpt.last_blocking_s)
        async_ckpt.wait()
        async_total_s.append(async_ckpt.last_total_s)
    print(f"model: {params / 1e6:.1f} M parameters, Adam; checkpoint ~{params * 12 / 2**30:.2f} GiB")
    print(f"sync save, median of {args.rounds}: {statistics.median(sync_s):.2f} s  ({', '.join(f'{x:.2f}' for x in sync_s)})")
    print(f"async save, blocking part:      {statistics.median(block_s):.2f} s  ({', '.join(f'{x:.2f}' for x in block_s)})")
    print(f"async save, until written:      {statistics.median(async_total_s):.2f} s  ({', '.join(f'{x:.2f}' for x in async_total_s)})")
    if len(block_s) > 1:  # the first asynchronous save allocates the host copy; later ones reuse it
        print(f"async blocking, first save: {block_s[0]:.2f} s; later saves, median: {statistics.median(block_s[1:]):.2f} s")
    print(f"blocking / sync = {statistics.median(block_s) / statistics.median(sync_s):.3f} (goal <= 0.10)")
    ctx.close()
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
