"""FSDP under bf16-mixed before and after its mixed-precision policy (issue 53, item 1), on 2 CPU ranks
(gloo), the lm task: the bytes FSDP2 all-gathers and reduce-scatters per step (counted by wrapping
``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` in each rank), and the steady-state
tokens/s of ``dtrain train --strategy fsdp --precision bf16-mixed``.

The old side is any checkout's ``src`` (``--old /tmp/base/src``: commit 2d0ef5e, fp32 gathers under
autocast), the new one this repository's. Each side runs in a fresh process, the sides alternate (the
order reversed every other round), and the table gives medians and the median of the paired ratios.

    flock /tmp/dtrain-bench.lock nice -n 5 python benchmarks/fsdp_precision.py --old /tmp/base/src --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
LM = {"layers": "4", "heads": "4", "width": "128", "context": "128", "max_bytes": "400000"}


def _count(steps: int, batch: int) -> dict:
    """One rank: ``steps`` fsdp steps under bf16-mixed, the collectives' bytes counted."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import dtrain
    from dtrain.tasks import load_task

    seen = {"gather": 0, "scatter": 0, "gather_dtypes": set()}
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

    def all_gather_single(out, inp, *a, **k):  # noqa: ANN001, ANN202
        seen["gather"] += out.numel() * out.element_size()
        seen["gather_dtypes"].add(str(out.dtype).removeprefix("torch."))
        return gather(out, inp, *a, **k)

    def reduce_scatter_single(output, input, *a, **k):  # noqa: A002, ANN001, ANN202  (FSDP2 passes them by name)
        seen["scatter"] += input.numel() * input.element_size()
        return scatter(output, input, *a, **k)

    task = load_task("lm", options=LM)
    ctx = dtrain.init("fsdp", precision="bf16-mixed", seed=0)
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = ctx.setup(model, opt, blocks=task.blocks(model))
    it = iter(ctx.setup_dataloader(DataLoader(task.train_set, batch_size=batch, shuffle=True)))
    dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
    try:
        for _ in range(steps):
            x, y = next(it)
            ctx.forward_backward(model, x, y, task.loss_fn)
            opt.step()
            opt.zero_grad()
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = gather, scatter
    params = sum(p.numel() for p in ctx.unwrap(model).parameters())
    ctx.close()
    return {"gather_per_step": seen["gather"] / steps, "scatter_per_step": seen["scatter"] / steps,
            "gather_dtypes": sorted(seen["gather_dtypes"]), "params": params}


def count_side(src: str, args: argparse.Namespace) -> dict:
    # the harness moved (dtrain.testing -> dtrain.launch.local after 2d0ef5e): each side uses its own
    code = (f"import sys, json; sys.path.insert(0, {HERE!r}); import fsdp_precision as b\n"
            "try:\n    from dtrain.launch.local import run_distributed\nexcept ImportError:\n    from dtrain.testing import run_distributed\n"
            f"print(json.dumps(run_distributed(b._count, {args.steps}, {args.batch}, world_size=2, timeout=600)[0]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(src), timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"count on {src} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _env(src: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}


def speed_side(src: str, args: argparse.Namespace) -> float:
    cmd = [sys.executable, "-m", "dtrain", "train", "--task", "lm", "-n", "2", "--strategy", "fsdp", "--precision", "bf16-mixed",
           *[a for k, v in LM.items() for a in ("--task-arg", f"{k}={v}")], "--batch-size", str(args.batch),
           "--max-steps", str(args.train_steps), "--warmup-steps", "5", "--log-every", str(args.train_steps), "--seed", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(src), timeout=1800, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"train on {src} failed:\n{proc.stderr[-3000:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["tokens_per_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="the old code's src folder (e.g. /tmp/base/src)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps counted per side")
    p.add_argument("--train-steps", type=int, default=40, help="steps of each dtrain train (5 of warm-up)")
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    sides = {"old": os.path.abspath(args.old), "new": SRC}
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  load {os.getloadavg()}  lm {LM} batch {args.batch}/rank, 2 ranks, gloo", flush=True)
    for name, src in sides.items():
        c = count_side(src, args)
        print(f"bytes {name}: all-gathered {c['gather_per_step']:,.0f} B/step ({', '.join(c['gather_dtypes'])}), "
              f"reduce-scattered {c['scatter_per_step']:,.0f} B/step, {c['params']:,} parameters", flush=True)
    rates: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            rates[name].append(speed_side(sides[name], args))
        print(f"round {r}: old {rates['old'][-1]:,.0f} tokens/s, new {rates['new'][-1]:,.0f}, "
              f"ratio {rates['new'][-1] / rates['old'][-1]:.3f}  (load {os.getloadavg()[0]:.1f})", flush=True)
    ratios = [n / o for n, o in zip(rates["new"], rates["old"])]
    print(f"tokens/s median: old {statistics.median(rates['old']):,.0f}, new {statistics.median(rates['new']):,.0f}; "
          f"median paired ratio new/old {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
