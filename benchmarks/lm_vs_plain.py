"""lm tokens/s: `dtrain train --task lm` against a nanoGPT-style plain DDP loop (torchrun).

Both sides train the same model (dtrain's GPT-style decoder, built by the same task function),
on the same windows of the same corpus, with the same per-process batch, context, optimizer
(AdamW, lr 1e-3), step count and thread count (OMP_NUM_THREADS, set for both). The plain side
is nanoGPT's train.py loop reduced to its DDP core: DistributedSampler, DDP, forward, loss,
backward, step, zero_grad(set_to_none=True). DDP gets dtrain's DDP options (an explicit
``bucket_cap_mb=25``, which also sizes the first bucket, and ``gradient_as_bucket_view=True``)
so that the two sides differ only by dtrain; ``--plain-torch-defaults`` gives it torch's
defaults instead (nanoGPT's ``DDP(model)``: a 1 MB first bucket, gradients copied into buckets). Both time the training
loop only (from the first step to the last; no data loading, no evaluation): dtrain reports
tokens/s = samples/s x context over that window, the plain loop the same.

Rounds alternate the sides (dtrain first in even rounds, plain first in odd ones); the result
is the median of each side and the median of the per-round ratios.

    flock /tmp/dtrain-bench.lock nice -n 5 python benchmarks/lm_vs_plain.py --rounds 5 --steps 40
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


def plain_worker(args: argparse.Namespace) -> None:
    """The nanoGPT-style loop (one rank, started by torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from dtrain.tasks import load_task  # model and data only (not timed)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    task = load_task("lm", options=dict(kv.split("=", 1) for kv in args.task_arg))
    torch.manual_seed(args.seed)
    options = {} if args.plain_torch_defaults else {"bucket_cap_mb": 25, "gradient_as_bucket_view": True}  # dtrain's DDPConfig
    model = DDP(task.build_model(), **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(task.train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(task.train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model.train()
    step, t0 = 0, time.perf_counter()
    for x, y in loader:
        logits = model(x)
        loss = task.loss_fn(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step >= args.steps:
            break
    elapsed = time.perf_counter() - t0
    if rank == 0:
        tokens = step * args.batch_size * task.tokens_per_sample * world
        print(json.dumps({"steps": step, "tokens_per_s": round(tokens / elapsed, 1), "train_loss": loss.item()}), flush=True)
    del model
    dist.destroy_process_group()


def _last_json(out: str) -> dict:
    return json.loads([ln for ln in out.strip().splitlines() if ln.startswith("{")][-1])


def run_side(side: str, args: argparse.Namespace, env: dict[str, str]) -> float:
    task_args = [a for kv in args.task_arg for a in ("--task-arg", kv)]
    common = ["--batch-size", str(args.batch_size), "--seed", str(args.seed)]
    if side == "dtrain":
        cmd = [sys.executable, "-m", "dtrain", "train", "--task", "lm", *task_args, *common, "-n", str(args.nproc),
               "--strategy", "ddp", "--max-steps", str(args.steps), "--log-every", str(args.steps)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), os.path.abspath(__file__),
               "--worker", *task_args, *common, "--steps", str(args.steps), *(["--plain-torch-defaults"] if args.plain_torch_defaults else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"{side} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return float(_last_json(proc.stdout)["tokens_per_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--task-arg", action="append", default=[], help="lm task option KEY=VALUE (default: the task's)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process (both sides)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None, help="append one JSON line per round here")
    p.add_argument("--plain-torch-defaults", action="store_true", help="plain side: DDP(model) with torch's defaults, not dtrain's options")
    args = p.parse_args()
    if args.worker:
        plain_worker(args)
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": os.pathsep.join(filter(None, (SRC, os.environ.get("PYTHONPATH"))))}
    rates: dict[str, list[float]] = {"dtrain": [], "plain": []}
    ratios = []
    for rnd in range(args.rounds):
        order = ("dtrain", "plain") if rnd % 2 == 0 else ("plain", "dtrain")
        got = {side: run_side(side, args, env) for side in order}
        for side, rate in got.items():
            rates[side].append(rate)
        ratios.append(got["dtrain"] / got["plain"])
        line = {"round": rnd, "order": order, "load1": os.getloadavg()[0], "plain_torch_defaults": args.plain_torch_defaults, **{f"{s}_tokens_per_s": r for s, r in got.items()}, "ratio": round(ratios[-1], 4)}
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(line) + "\n")
    print(json.dumps({"dtrain_tokens_per_s_median": statistics.median(rates["dtrain"]),
                      "plain_tokens_per_s_median": statistics.median(rates["plain"]),
                      "ratio_median": round(statistics.median(ratios), 4), "ratios": [round(r, 4) for r in ratios]}))


if __name__ == "__main__":
    main()
