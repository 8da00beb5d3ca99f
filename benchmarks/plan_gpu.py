"""`dtrain plan` against `dtrain train` on the one GPU at hand (issue 31, the single-device end).

Two ways the plan predicts a GPU's step: from the model's FLOPs and an achieved fraction of the
named device's peak (``--device h200``: ``--mfu``, default 0.4), or timed on this GPU
(``--device cuda``). Its memory comes from the model's tensors and saved activations counted on the
meta device (autocast's casts and the GPU's fused attention emulated there). Per configuration:

1. `dtrain plan --json -n 1 --layouts single`, once with the preset named from torch.cuda's device
   name and once with ``--device cuda``: step_ms and peak_mib_per_rank of each;
2. `dtrain train --device cuda` ``--repeats`` times: the wall time per step over steps 10 to
   ``--steps`` (the --metrics-file records' wall_s), the breakdown's median step, the allocator's
   peak (``torch.cuda.max_memory_allocated``, the records' ``peak_mib``) and the run's MFU.

One JSON line per configuration (``--out``) and a table. The plan trains nothing; nothing is
fitted: the measured MFU is printed beside the plan's assumed one.

    python benchmarks/plan_gpu.py --out rows.jsonl           # on a GPU
    python benchmarks/plan_gpu.py --device cpu --quick       # tiny sizes on CPU: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")

GPT = ["layers=12", "heads=12", "width=768", "context=1024", "max_bytes=20000000"]
RESNET = ["source=synthetic", "model=resnet50", "size=224", "samples=2048"]
FULL = {  # name: (task, task args, batch, extra flags)
    "lm-124m": ("lm", GPT, 16, []),
    "lm-124m-ac": ("lm", GPT, 16, ["--activation-checkpointing"]),
    "resnet50": ("images", RESNET, 128, []),
}
QUICK = {
    "lm-tiny": ("lm", ["layers=2", "heads=2", "width=64", "context=64", "max_bytes=200000"], 8, []),
    "lm-tiny-ac": ("lm", ["layers=2", "heads=2", "width=64", "context=64", "max_bytes=200000"], 8, ["--activation-checkpointing"]),
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}


def task_flags(task: str, targs: list[str], batch: int, extra: list[str], precision: str) -> list[str]:
    out = ["--task", task, "--batch-size", str(batch), "--precision", precision, *extra]
    for a in targs:
        out += ["--task-arg", a]
    return out


def plan_device(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0)
    for kind in ("h200", "h100", "a100"):
        if kind in name.lower():
            return kind
    raise SystemExit(f"plan_gpu: no plan preset for the GPU {name!r}; pass --plan-device (h100, h200, a100, ...)")


def plan(flags: list[str], device: str) -> dict:
    cmd = [sys.executable, "-m", "dtrain", "plan", "--json", *flags, "--device", device, "-n", "1"]
    if device != "cpu":
        cmd += ["--layouts", "single"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env())
    if out.returncode:
        raise RuntimeError(f"plan failed: {out.stderr[-2000:]}")
    data = json.loads(out.stdout)
    row = next(r for r in data["layouts"] if r["layout"] == "single")
    return {"step_ms": row["step_ms"], "peak_mib": row["peak_mib_per_rank"], "mem_mib": row["mem_mib_per_rank"],
            "phases_ms": row["phases_ms"], "memory_mib": row["memory_mib"],
            "mfu": data["cluster"].get("achieved_fraction"), "fwd_gflops_per_sample": data["model"].get("fwd_gflops_per_sample")}


def train(flags: list[str], device: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        cmd = [sys.executable, "-m", "dtrain", "train", *flags, "--device", device, "--max-steps", str(steps), "--log-every", "10",
               "--metrics-file", metrics]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env())
        if out.returncode:
            raise RuntimeError(f"train failed: {out.stdout[-1000:]} {out.stderr[-2000:]}")
        with open(metrics) as fh:
            records = [json.loads(line) for line in fh if line.strip() and "wall_s" in line]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    records = [r for r in records if "step" in r and "wall_s" in r]
    first, last = records[0], records[-1]
    return {"window_ms": (last["wall_s"] - first["wall_s"]) / (last["step"] - first["step"]) * 1e3,
            "median_ms": statistics.mean(b["median_ms"]["step"] for b in result["breakdown"]),
            "peak_mib": max(last.get("peak_mib") or [0]) or None, "mfu": result.get("mfu"),
            "phases_ms": result["breakdown"][-1]["median_ms"]}


def err(pred: float, meas: float | None) -> str:
    return "-" if not meas else f"{(pred - meas) / meas * 100:+.1f}%"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --quick: checks that it runs)")
    p.add_argument("--plan-device", default=None, help="the plan's device preset (default: from the GPU's name)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--only", default=None, help="comma-separated configuration names")
    p.add_argument("--out", default=None, help="append one JSON line per configuration here")
    args = p.parse_args()
    configs = QUICK if args.quick else FULL
    if args.only:
        configs = {k: v for k, v in configs.items() if k in args.only.split(",")}
    precision = "bf16-mixed" if args.device == "cuda" else "fp32"
    device = args.plan_device or plan_device(args.device)
    rows = []
    for name, (task, targs, batch, extra) in configs.items():
        flags = task_flags(task, targs, batch, extra, precision)
        devices = [device] if args.device == "cpu" else [device, "cuda"]
        preds = {d: plan(flags, d) for d in devices}
        pred = preds[device]
        runs = [train(flags, args.device, args.steps) for _ in range(args.repeats)]
        row = {"config": name, "plan_device": device, "flags": flags, "predicted": pred, "predicted_by_device": preds, "runs": runs,
               "meas_window_ms": statistics.median(r["window_ms"] for r in runs),
               "meas_median_ms": statistics.median(r["median_ms"] for r in runs),
               "meas_peak_mib": statistics.median(r["peak_mib"] for r in runs if r["peak_mib"]) if any(r["peak_mib"] for r in runs) else None,
               "meas_mfu": statistics.median(r["mfu"] for r in runs if r["mfu"]) if any(r["mfu"] for r in runs) else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    print("\n| config | plan step ms (device: step) | measured step ms (window / median) | error | plan peak MiB | measured peak MiB "
          "| error | plan MFU | measured MFU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for dev, pr in r["predicted_by_device"].items():
            print(f"| {r['config']} | {dev}: {pr['step_ms']:.1f} | {r['meas_window_ms']:.1f} / {r['meas_median_ms']:.1f} "
                  f"| {err(pr['step_ms'], r['meas_window_ms'])} | {pr['peak_mib']:.0f} | {r['meas_peak_mib'] or 0:.0f} "
                  f"| {err(pr['peak_mib'], r['meas_peak_mib'])} | {pr['mfu']} | {r['meas_mfu']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
