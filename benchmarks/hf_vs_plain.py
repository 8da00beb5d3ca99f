"""HF model tokens/s: `dtrain train --task hf:DIR --strategy ddp` against the same transformers model in a
plain DDP loop (torchrun), 2 ranks.

The model folder is written here from a Llama-style config (no download; sizes from the flags).
Both sides train transformers' LlamaForCausalLM from that folder, seeded alike, on the same
windows of the same corpus (the data come from dtrain's hf task, built before the timed loop),
with the same per-process batch, AdamW (lr 1e-3), step count and thread count
(OMP_NUM_THREADS). The plain side is the DDP core of a hand-written loop: DistributedSampler,
``DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=True)`` (dtrain's DDP options, so the
sides differ only by dtrain), ``model(input_ids=x, use_cache=False).logits``, the same cross
entropy, backward, step, zero_grad(set_to_none=True). Both leave the first ``--warmup`` steps
out of the rate (dtrain's ``--warmup-steps``, its steady-state meter), and time to the last
step; no evaluation in the plain loop's window (dtrain evaluates after its window).

Rounds alternate the sides (dtrain first in even rounds, plain first in odd ones); the result
is the median of each side and the median of the per-round ratios.

    flock /tmp/dtrain-bench.lock nice -n 5 python benchmarks/hf_vs_plain.py --rounds 5 --steps 30 \\
        --out benchmarks/results/hf_vs_plain-$(date +%F).jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")


def write_folder(path: str, args: argparse.Namespace) -> None:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.heads // 2, max_position_embeddings=args.context).save_pretrained(path)


def plain_worker(args: argparse.Namespace) -> None:
    """The plain loop (one rank, started by torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from transformers import AutoConfig, AutoModelForCausalLM

    from dtrain.tasks import load_task  # the data only (not timed)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    task = load_task(f"hf:{args.folder}", options={"context": str(args.context), "max_bytes": str(args.max_bytes)})
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.folder, local_files_only=True)
    model = DDP(AutoModelForCausalLM.from_config(config, dtype=torch.float32), bucket_cap_mb=25, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(task.train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(task.train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model.train()
    step, t0 = 0, None
    for x, y in loader:
        if step == args.warmup:
            t0 = time.perf_counter()
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step >= args.steps:
            break
    elapsed = time.perf_counter() - t0
    if rank == 0:
        tokens = (step - args.warmup) * args.batch_size * args.context * world
        print(json.dumps({"steps": step, "tokens_per_s": round(tokens / elapsed, 1), "train_loss": loss.item()}), flush=True)
    del model
    dist.destroy_process_group()


def _last_json(out: str) -> dict:
    return json.loads([ln for ln in out.strip().splitlines() if ln.startswith("{")][-1])


def run_side(side: str, args: argparse.Namespace, env: dict[str, str]) -> float:
    common = ["--batch-size", str(args.batch_size), "--seed", str(args.seed)]
    if side == "dtrain":
        cmd = [sys.executable, "-m", "dtrain", "train", "--task", f"hf:{args.folder}", "--task-arg", f"context={args.context}",
               "--task-arg", f"max_bytes={args.max_bytes}", *common, "-n", str(args.nproc), "--strategy", "ddp",
               "--max-steps", str(args.steps), "--warmup-steps", str(args.warmup), "--log-every", str(args.steps)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), os.path.abspath(__file__),
               "--worker", "--folder", args.folder, *common, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--context", str(args.context), "--max-bytes", str(args.max_bytes)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"{side} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return float(_last_json(proc.stdout)["tokens_per_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--max-bytes", type=int, default=400_000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the rate (both sides)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process (both sides)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None, help="append one JSON line per round here")
    args = p.parse_args()
    if args.worker:
        plain_worker(args)
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (SRC, os.environ.get("PYTHONPATH"))))}
    rates: dict[str, list[float]] = {"dtrain": [], "plain": []}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        args.folder = os.path.join(tmp, "llama")
        write_folder(args.folder, args)
        for rnd in range(args.rounds):
            order = ("dtrain", "plain") if rnd % 2 == 0 else ("plain", "dtrain")
            got = {side: run_side(side, args, env) for side in order}
            for side, rate in got.items():
                rates[side].append(rate)
            ratios.append(got["dtrain"] / got["plain"])
            line = {"round": rnd, "order": order, "load1": os.getloadavg()[0], "hidden": args.hidden, "layers": args.layers,
                    "context": args.context, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                    **{f"{s}_tokens_per_s": r for s, r in got.items()}, "ratio": round(ratios[-1], 4)}
            print(json.dumps(line), flush=True)
            if args.out:
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(line) + "\n")
    print(json.dumps({"dtrain_tokens_per_s_median": statistics.median(rates["dtrain"]),
                      "plain_tokens_per_s_median": statistics.median(rates["plain"]),
                      "ratio_median": round(statistics.median(ratios), 4), "ratios": [round(r, 4) for r in ratios]}))


if __name__ == "__main__":
    main()
