"""What --compile and --activation-checkpointing do on this machine (one process, CPU).

``speed``: steady-state training throughput with and without ``dtrain.init(compile=True)``, on
the lm task (tokens/s) or torchvision's resnet18 (images/s, random 3x64x64 inputs). Each side
runs in a fresh process: ``--warmup`` steps (compilation happens there, not timed), then
``--steps`` timed steps. Sides alternate per round (off first in even rounds); medians and the
median of the per-round ratios are reported. Compilation time is reported separately.

``memory``: activation memory of lm with and without ``activation_checkpointing=True``, at
equal loss, measured two ways in a fresh process per side on the first training step:
  * saved bytes: bytes of the tensors autograd keeps from forward for backward, counted with
    ``torch.autograd.graph.saved_tensors_hooks`` (each storage once; parameters excluded). With
    checkpointing, a block's inner tensors go through checkpoint's own hook and are not kept:
    what the outer hook sees is what stays alive until backward;
  * RSS growth: resident memory after forward minus before it (the process's first forward,
    so no freed memory from an earlier step is reused).
Then ``--steps`` steps are trained on each side to check the losses agree.

    flock /tmp/dtrain-bench.lock nice -n 5 python benchmarks/lm_switches.py speed --rounds 3
    flock /tmp/dtrain-bench.lock nice -n 5 python benchmarks/lm_switches.py memory --task-arg context=256
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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _workload(args: argparse.Namespace):
    """(build_model, blocks, batch_fn, loss_fn, items_per_sample)."""
    import torch

    if args.model == "resnet18":
        import torchvision

        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(args.batch_size, 3, 64, 64, generator=g), torch.randint(0, 1000, (args.batch_size,), generator=g)
        build = torchvision.models.resnet18

        def blocks(m):
            return [m.layer1, m.layer2, m.layer3, m.layer4]

        return build, blocks, lambda i: (x, y), torch.nn.functional.cross_entropy, 1
    from dtrain.tasks import load_task

    task = load_task("lm", options=dict(kv.split("=", 1) for kv in args.task_arg))
    data = task.train_set

    def batch(i):
        items = [data[(i * args.batch_size + k) % len(data)] for k in range(args.batch_size)]
        return torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])

    return task.build_model, task.blocks, batch, task.loss_fn, task.tokens_per_sample


def worker(args: argparse.Namespace) -> dict:
    import torch

    import dtrain

    build, blocks, batch, loss_fn, per_sample = _workload(args)
    ctx = dtrain.init("single", seed=0, compile=args.on and args.what == "speed",
                      activation_checkpointing=args.on and args.what == "memory")
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = ctx.setup(model, opt, blocks=blocks(model))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out: dict = {"on": args.on}
    if args.what == "memory":
        seen: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        x, y = batch(0)
        before = _rss_bytes()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model(x), y)
        out["rss_growth_mib"] = round((_rss_bytes() - before) / 2**20, 1)
        out["saved_mib"] = round(sum(seen.values()) / 2**20, 2)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses = [loss.item()]
        for i in range(1, args.steps):
            x, y = batch(i)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out["losses"] = losses
        return out
    t0 = time.perf_counter()
    for i in range(args.warmup):
        x, y = batch(i)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out["warmup_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    for i in range(args.steps):
        x, y = batch(args.warmup + i)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    elapsed = time.perf_counter() - t0
    out["rate"] = round(args.steps * args.batch_size * per_sample / elapsed, 1)
    out["final_loss"] = loss.item()
    return out


def run_side(args: argparse.Namespace, on: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), args.what, "--worker", *(["--on"] if on else []),
           "--model", args.model, "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
           *[a for kv in args.task_arg for a in ("--task-arg", kv)]]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": os.pathsep.join(filter(None, (SRC, os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"side on={on} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("speed", "memory"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--on", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="lm", choices=("lm", "resnet18"))
    p.add_argument("--task-arg", action="append", default=[], help="lm task option KEY=VALUE")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return
    rows = []
    for rnd in range(args.rounds if args.what == "speed" else 1):
        order = (False, True) if rnd % 2 == 0 else (True, False)
        got = {on: run_side(args, on) for on in order}
        rows.append(got)
        print(json.dumps({"round": rnd, "off": got[False], "on": got[True]}), flush=True)
    if args.what == "speed":
        ratios = [r[True]["rate"] / r[False]["rate"] for r in rows]
        print(json.dumps({"model": args.model, "off_rate_median": statistics.median(r[False]["rate"] for r in rows),
                          "on_rate_median": statistics.median(r[True]["rate"] for r in rows),
                          "speedup_median": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios]}))


if __name__ == "__main__":
    main()
