"""Per-rank memory and speed of ddp, zero1 and fsdp on 2 CPU ranks (gloo), Adam, a stack of
Linear layers of a few hundred million parameters.

Each method runs in its own 2 processes (so peak RSS is that method's own); the methods run in
the order given, then again in reverse (ABBA), and the table reports, per method, the median
over its runs of: parameter, gradient and optimizer-state bytes of one rank (from
``ctx.memory_report``, measured after an optimizer step, before ``zero_grad``), the peak
resident set size of the larger rank (``ru_maxrss``, the whole process: torch, buffers, the
full model each rank builds before ``ctx.setup``), and samples/s over the measured steps.

    flock /tmp/dtrain-bench.lock nice -n 10 python benchmarks/sharded_memory.py --width 4096 --layers 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import dtrain
from dtrain.launch.local import run_distributed


def one_method(strategy: str, width: int, layers: int, batch: int, warmup: int, steps: int) -> dict:
    """One rank of one method. Collective: runs on every rank."""
    torch.set_num_threads(1)
    ctx = dtrain.init(strategy, seed=0, **({"wrap": "Linear"} if strategy == "fsdp" else {}))
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(net.parameters(), lr=1e-5)
    model, opt = ctx.setup(net, opt)
    del net
    g = torch.Generator().manual_seed(ctx.rank)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    loss_fn = torch.nn.functional.mse_loss
    report = None
    times = []
    for i in range(warmup + steps):
        ctx.barrier()
        t0 = time.perf_counter()
        ctx.forward_backward(model, x, y, loss_fn)
        opt.step()
        if report is None:
            report = ctx.memory_report(model, opt)  # gradients and optimizer state both exist here
        opt.zero_grad(set_to_none=True)
        ctx.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    final = ctx.memory_report(model, opt)
    out = {"strategy": strategy, "rank": ctx.rank, "params_bytes": report.params_bytes, "grads_bytes": report.grads_bytes,
           "optimizer_bytes": report.optimizer_bytes, "state_bytes": report.state_bytes, "peak_rss_bytes": final.peak_bytes,
           "samples_per_s": batch * ctx.data_parallel_size / statistics.median(times),
           "params_total": sum(p.numel() for p in model.original.parameters())}
    ctx.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="ddp,zero1,fsdp")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="passes over the methods, alternating their order")
    p.add_argument("--json", default=None, help="also write every run's records here")
    args = p.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    runs: dict[str, list[list[dict]]] = {m: [] for m in methods}
    for r in range(args.rounds):
        for m in methods if r % 2 == 0 else list(reversed(methods)):
            t0 = time.perf_counter()
            ranks = run_distributed(one_method, m, args.width, args.layers, args.batch, args.warmup, args.steps,
                                    world_size=2, timeout=1200)
            runs[m].append(ranks)
            print(f"round {r + 1}: {m} done in {time.perf_counter() - t0:.0f} s: "
                  f"peak RSS {max(x['peak_rss_bytes'] for x in ranks) / 2**30:.2f} GiB, "
                  f"{ranks[0]['samples_per_s']:.2f} samples/s", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(runs, fh, indent=1)
    params = runs[methods[0]][0][0]["params_total"]
    gib = 2**30
    print(f"\n{params / 1e6:.0f} M parameters ({args.layers} x Linear({args.width}, {args.width})), Adam, 2 ranks, "
          f"batch {args.batch}/rank, median of {args.rounds} run(s) x {args.steps} steps")
    print("| method | params GiB/rank | grads GiB/rank | optimizer GiB/rank | state GiB/rank | state vs ddp | peak RSS GiB (max rank) | samples/s |")
    print("|---|---|---|---|---|---|---|---|")
    base = statistics.median(max(x["state_bytes"] for x in rr) for rr in runs[methods[0]])
    for m in methods:
        med = lambda key, agg=max: statistics.median(agg(x[key] for x in rr) for rr in runs[m])  # noqa: E731
        print(f"| {m} | {med('params_bytes') / gib:.2f} | {med('grads_bytes') / gib:.2f} | {med('optimizer_bytes') / gib:.2f} | "
              f"{med('state_bytes') / gib:.2f} | {med('state_bytes') / base:.2f}x | {med('peak_rss_bytes') / gib:.2f} | "
              f"{statistics.median(rr[0]['samples_per_s'] for rr in runs[m]):.2f} |")


if __name__ == "__main__":
    main()
