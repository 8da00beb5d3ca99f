"""--compile's choices on the lm, measured: the whole model against each block compiled apart,
and torch.compile's modes, each against eager; compile time apart (issue 28, item 3).

Each run is a fresh process (inductor's caches off, so each compiles from scratch) training the
lm task's model with AdamW for ``--warmup`` steps (compilation, timed apart as ``compile_s``)
and ``--steps`` measured steps (``step_ms``: median step time after warm-up). Rounds alternate
the order of the variants (reversed every other round); the result is each variant's median and
its median per-round ratio of steady speed to eager, so a load that drifts cancels out.

    python benchmarks/compile_modes.py --rounds 3 --steps 20 --out benchmarks/results/28-compile-modes.jsonl
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
VARIANTS = ("eager", "whole", "blocks", "whole-max-autotune-no-cudagraphs", "blocks-max-autotune-no-cudagraphs")


def worker(args: argparse.Namespace) -> None:
    import torch

    from dtrain.tasks import load_task

    device = torch.device(args.device)
    task = load_task("lm", options=dict(kv.split("=", 1) for kv in args.task_arg))
    torch.manual_seed(0)
    model = task.build_model().to(device)
    scope, _, mode = args.variant.partition("-")
    options = {"mode": mode} if mode else {}
    if scope == "whole":
        model.compile(**options)
    elif scope == "blocks":
        for block in task.blocks(model):
            block.compile(**options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, len(task.train_set), (args.batch_size * (args.warmup + args.steps),), generator=g)
    batches = [[t.to(device) for t in torch.utils.data.default_collate([task.train_set[int(i)] for i in chunk])]
               for chunk in index.split(args.batch_size)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, loss = [], None
    for x, y in batches:
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = task.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
    steady = times[args.warmup:]
    step_s = statistics.median(steady)
    print(json.dumps({"variant": args.variant, "compile_s": round(sum(times[:args.warmup]) - args.warmup * step_s, 3),
                      "step_ms": round(step_s * 1e3, 3), "tokens_per_s": round(args.batch_size * task.tokens_per_sample / step_s, 1),
                      "loss": round(loss.item(), 4)}), flush=True)


def run(variant: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant, "--device", args.device,
           "--batch-size", str(args.batch_size), "--warmup", str(args.warmup), "--steps", str(args.steps),
           *(["--bf16"] if args.bf16 else []), *[a for kv in args.task_arg for a in ("--task-arg", kv)]]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"timed out after {args.timeout} s"}
    if proc.returncode != 0:
        return {"variant": variant, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="eager")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--task-arg", action="append", default=[], help="lm task option KEY=VALUE (default: the task's)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    variants = args.variants.split(",")
    cache = tempfile.mkdtemp(prefix="dtrain-compile-bench-")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (SRC, os.environ.get("PYTHONPATH")))),
           "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "TORCHINDUCTOR_CACHE_DIR": cache}
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    for rnd in range(args.rounds):
        order = variants if rnd % 2 == 0 else list(reversed(variants))
        got = {v: run(v, args, env) for v in order}
        for v, r in got.items():
            rows[v].append(r)
            if "error" not in r and "error" not in got.get("eager", {"error": 1}):
                ratios[v].append(got["eager"]["step_ms"] / r["step_ms"])
        line = {"round": rnd, "order": order, "load1": round(os.getloadavg()[0], 2), "runs": got}
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(line) + "\n")
    print("\n| variant | step ms (median) | speed vs eager (median of rounds) | compile s (median) | runs |\n|---|---|---|---|---|")
    for v in variants:
        ok = [r for r in rows[v] if "error" not in r]
        if not ok:
            print(f"| {v} | failed: {rows[v][-1]['error']} | | | 0 |")
            continue
        print(f"| {v} | {statistics.median(r['step_ms'] for r in ok):.1f} | "
              f"{statistics.median(ratios[v]) if ratios[v] else float('nan'):.3f}x | "
              f"{statistics.median(r['compile_s'] for r in ok):.1f} | {len(ok)} |")


if __name__ == "__main__":
    main()
