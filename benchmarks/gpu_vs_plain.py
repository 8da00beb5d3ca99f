"""dtrain against hand-written loops on one device (issue 28's table), for anyone with a GPU:

- LM (GPT 12x768, context 1024, batch 16, bf16 on CUDA): ``dtrain train --task lm`` eager and with
  ``--compile``, against a plain eager loop and a plain loop with ``torch.compile(model)``;
- ResNet-50 (batch 128, bf16, channels-last on CUDA), ``source=synthetic``: ``dtrain train --task
  images`` at its defaults, against a plain loop fed by a DataLoader with 4 workers, and a plain loop
  that keeps one batch on the device (Horovod's synthetic benchmark).

Every side is a fresh process; every figure is steady state (the first ``--warmup`` steps left
out, their time apart). Rounds alternate the order of the sides (reversed every other round);
the table gives each side's median and the median of its per-round ratio to the reference side.

    python benchmarks/gpu_vs_plain.py                       # on a GPU, the issue's sizes
    python benchmarks/gpu_vs_plain.py --device cpu --quick  # tiny sizes: checks that it runs
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


def sizes(args: argparse.Namespace) -> dict:
    out = _sizes(args)
    if getattr(args, "steps", None):
        out["steps"] = args.steps
    return out


def _sizes(args: argparse.Namespace) -> dict:
    if args.quick:
        return {"lm": ["layers=1", "heads=2", "width=32", "context=32", "max_bytes=200000"], "lm_batch": 4,
                "model": "resnet18", "size": 32, "img_batch": 8, "steps": 8, "warmup": 3, "loader_workers": 2}
    return {"lm": ["layers=12", "heads=12", "width=768", "context=1024", "max_bytes=20000000"], "lm_batch": 16,
            "model": "resnet50", "size": 224, "img_batch": 128, "steps": 100, "warmup": 20, "loader_workers": 4}


def plain(args: argparse.Namespace) -> None:
    """One plain side (``--worker plain-lm-eager | plain-lm-compile | plain-img-loader | plain-img-device``)."""
    import torch
    from torch.utils.data import DataLoader

    from dtrain.tasks import load_task  # model and data only

    s, device, kind = sizes(args), torch.device(args.device), args.worker.removeprefix("plain-")
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    if kind.startswith("lm"):
        task = load_task("lm", options=dict(kv.split("=", 1) for kv in s["lm"]))
        batch, per_sample = s["lm_batch"], task.tokens_per_sample
        model = task.build_model().to(device)
        loader = DataLoader(task.train_set, batch_size=batch, shuffle=True, drop_last=True, pin_memory=cuda)
    else:
        task = load_task("images", options={"source": "synthetic", "model": s["model"], "size": str(s["size"]),
                                             "samples": str(s["img_batch"] * 8)})
        batch, per_sample = s["img_batch"], 1
        model = task.build_model().to(device, memory_format=torch.channels_last if cuda else torch.contiguous_format)
        workers = s["loader_workers"] if kind == "img-loader" else 0
        loader = DataLoader(task.train_set, batch_size=batch, shuffle=True, drop_last=True, pin_memory=cuda, num_workers=workers,
                            persistent_workers=workers > 0)
    if kind == "lm-compile":
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if kind.startswith("lm") else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fixed = None
    if kind == "img-device":
        x, y = next(iter(loader))
        fixed = x.to(device).contiguous(memory_format=torch.channels_last if cuda else torch.contiguous_format), y.to(device)

    def batches():
        while True:
            for x, y in loader:
                yield fixed if fixed is not None else (x.to(device, non_blocking=True), y.to(device, non_blocking=True))

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    it, total = batches(), s["warmup"] + s["steps"]
    t_start = time.perf_counter()
    for step in range(total):
        if step == s["warmup"]:
            sync()
            t_warm = time.perf_counter()
        x, y = next(it)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed"):
            loss = task.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    t_end = time.perf_counter()
    print(json.dumps({"per_s": round(s["steps"] * batch * per_sample / (t_end - t_warm), 2), "warmup_s": round(t_warm - t_start, 2),
                      "loss": round(loss.item(), 4)}), flush=True)


def dtrain_cmd(side: str, args: argparse.Namespace) -> list[str]:
    s = sizes(args)
    steps = ["--max-steps", str(s["warmup"] + s["steps"]), "--warmup-steps", str(s["warmup"]), "--log-every", str(s["steps"])]
    common = ["--device", args.device, "--precision", args.precision, *steps]
    if side.startswith("dtrain-lm"):
        opts = [a for kv in s["lm"] for a in ("--task-arg", kv)]
        return ["train", "--task", "lm", *opts, "--batch-size", str(s["lm_batch"]), *common,
                *(["--compile"] if side.startswith("dtrain-lm-compile") else []), *(["--no-breakdown"] if side.endswith("-nobd") else [])]
    opts = [a for kv in ("source=synthetic", f"model={s['model']}", f"size={s['size']}", f"samples={s['img_batch'] * 8}")
            for a in ("--task-arg", kv)]
    return ["train", "--task", "images", *opts, "--batch-size", str(s["img_batch"]), *common,
            *(["--channels-last"] if args.device.startswith("cuda") else [])]


def run_side(side: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    if side.startswith("dtrain"):
        cmd = [sys.executable, "-m", "dtrain", *dtrain_cmd(side, args)]
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--device", args.device, "--precision", args.precision,
               *(["--quick"] if args.quick else []), *(["--steps", str(args.steps)] if args.steps else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, stdin=subprocess.DEVNULL)
    if args.logs:  # e.g. with TORCH_LOGS=recompiles,graph_breaks set: what each side's compile did
        with open(args.logs, "a") as fh:
            fh.write(f"== {side} (exit {proc.returncode})\n{proc.stderr}\n")
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
    out = json.loads([ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")][-1])
    if side.startswith("dtrain"):
        per_s = out.get("tokens_per_s") if side.startswith("dtrain-lm") else out.get("samples_per_s")
        bd = (out.get("breakdown") or [{}])[-1].get("median_ms")
        return {"per_s": per_s, "warmup_s": out.get("warmup_s"), "loss": out.get("train_loss"), "data_wait_share": out.get("data_wait_share"),
                **({"breakdown_ms": bd} if bd else {})}
    return out


TABLES = {
    "LM tokens/s": ("plain-lm-eager", ["dtrain-lm-eager", "plain-lm-eager", "dtrain-lm-compile", "plain-lm-compile"]),
    "ResNet images/s (synthetic)": ("plain-img-device", ["dtrain-img", "plain-img-loader", "plain-img-device"]),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--precision", default=None, help="default: bf16-mixed on CUDA, fp32 on CPU")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few steps: checks that every side runs")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="steady-state steps per side (default: 100; --quick 8)")
    p.add_argument("--only", default=None, choices=("lm", "images"), help="one of the two tables")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=None, help="append one JSON line per round here")
    p.add_argument("--logs", default=None, help="append each side's stderr here")
    p.add_argument("--sides", default=None, help="comma-separated sides of the lm table instead of its four (also: "
                   "dtrain-lm-compile-nobd, dtrain-lm-eager-nobd: without the per-step breakdown's CUDA events and hooks)")
    args = p.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.precision = args.precision or ("bf16-mixed" if args.device.startswith("cuda") else "fp32")
    if args.worker:
        plain(args)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (SRC, os.environ.get("PYTHONPATH"))))}
    for title, (ref, sides) in TABLES.items():
        if args.only and (args.only == "lm") != title.startswith("LM"):
            continue
        if args.sides and title.startswith("LM"):
            sides = args.sides.split(",")
            ref = ref if ref in sides else sides[0]
        got: dict[str, list[dict]] = {s: [] for s in sides}
        ratios: dict[str, list[float]] = {s: [] for s in sides}
        for rnd in range(args.rounds):
            order = sides if rnd % 2 == 0 else list(reversed(sides))
            this = {s: run_side(s, args, env) for s in order}
            for s, r in this.items():
                got[s].append(r)
                if r.get("per_s") and this[ref].get("per_s"):
                    ratios[s].append(r["per_s"] / this[ref]["per_s"])
            line = {"table": title, "round": rnd, "order": order, "device": args.device, "load1": round(os.getloadavg()[0], 2), "runs": this}
            print(json.dumps(line), file=sys.stderr, flush=True)
            if args.out:
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(line) + "\n")
        print(f"\n{title} on {args.device} ({args.precision}{', quick sizes' if args.quick else ''}), {args.rounds} round(s), medians")
        print(f"| side | {title.split()[1]} | vs {ref} | warm-up s | runs |\n|---|---|---|---|---|")
        for s in sides:
            ok = [r for r in got[s] if r.get("per_s")]
            if not ok:
                print(f"| {s} | failed: {got[s][-1].get('error')} | | | 0 |")
                continue
            warm = [r["warmup_s"] for r in ok if r.get("warmup_s") is not None]
            print(f"| {s} | {statistics.median(r['per_s'] for r in ok):,.1f} | {statistics.median(ratios[s]):.2f}x | "
                  f"{statistics.median(warm) if warm else float('nan'):.1f} | {len(ok)} |")


if __name__ == "__main__":
    main()
