"""float8 linears against bf16 on one device (issue 53): ``dtrain train --task lm`` with ``--precision
float8`` and with ``--precision bf16-mixed``, both with ``--compile``, on an LM whose linears are large
enough for float8 to gain (width 4096, 4 blocks, context 1024, batch 16 on a GPU), each side a fresh process,
the same seed and data order on both, rounds alternating the order of the sides.

Reported per side: tokens/s (steady state: the first ``--warmup`` steps, compilation among them, left out and
reported as warm-up), the loss after the last step, and the ratio to bf16 in the same round; the table gives
medians over rounds.

    python benchmarks/float8_vs_bf16.py --out f8.jsonl                 # on a GPU with float8 (compute capability >= 8.9)
    python benchmarks/float8_vs_bf16.py --device cpu --quick --emulate  # tiny sizes, torchao's emulation: checks that it runs
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

SHAPES = {
    "gpu": {"lm": ["layers=4", "heads=32", "width=4096", "context=1024", "max_bytes=8000000"], "batch": 16},
    "quick": {"lm": ["layers=2", "heads=2", "width=64", "context=32", "max_bytes=200000"], "batch": 4},
}


def command(side: str, args: argparse.Namespace) -> list[str]:
    shape = SHAPES["quick" if args.quick else "gpu"]
    precision = "float8" if side.startswith("float8") else "bf16-mixed"
    cmd = ["train", "--task", "lm", *[a for kv in shape["lm"] for a in ("--task-arg", kv)],
           "--batch-size", str(shape["batch"]), "--device", args.device, "--precision", precision,
           "--max-steps", str(args.steps), "--warmup-steps", str(args.warmup), "--log-every", str(args.steps),
           "--seed", "0", *(["--compile"] if args.compile else [])]
    if precision == "float8":
        cmd += ["--float8-recipe", side.removeprefix("float8-")] if side != "float8" else []
        cmd += ["--float8-emulate"] if args.emulate else []
    return cmd


def run_side(side: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "dtrain", *command(side, args)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, stdin=subprocess.DEVNULL)
    if args.logs:
        with open(args.logs, "a") as fh:
            fh.write(f"== {side} (exit {proc.returncode}): {' '.join(cmd[2:])}\n{proc.stderr}\n")
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300], "wall_s": round(time.perf_counter() - t0, 1)}
    out = json.loads([ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")][-1])
    return {"tokens_per_s": out.get("tokens_per_s"), "warmup_s": out.get("warmup_s"), "loss": out.get("train_loss"),
            "mfu": out.get("mfu"), "precision": out.get("precision"), "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that every side runs")
    p.add_argument("--emulate", action="store_true", help="torchao's float8 emulation (CPU, or a GPU without float8)")
    p.add_argument("--sides", default="bf16,float8", help="bf16, float8 (tensorwise), float8-rowwise; the first is the reference")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per side, warm-up included (default 200)")
    p.add_argument("--warmup", type=int, default=20, help="steps left out of the rate (compilation among them)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager on both sides")
    p.add_argument("--budget", type=float, default=None, help="seconds: start no round after this much time")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None, help="append one JSON line per round here")
    p.add_argument("--logs", default=None, help="append each side's command and stderr here")
    args = p.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (SRC, os.environ.get("PYTHONPATH"))))}
    sides = args.sides.split(",")
    ref = sides[0]
    got: dict[str, list[dict]] = {s: [] for s in sides}
    ratios: dict[str, list[float]] = {s: [] for s in sides}
    t_start = time.monotonic()
    for rnd in range(args.rounds):
        if rnd and args.budget and time.monotonic() - t_start > args.budget:
            print(f"round {rnd}: not started (--budget {args.budget:g} s spent)", file=sys.stderr)
            break
        order = sides if rnd % 2 == 0 else list(reversed(sides))
        this = {s: run_side(s, args, env) for s in order}
        for s, r in this.items():
            got[s].append(r)
            if r.get("tokens_per_s") and this[ref].get("tokens_per_s"):
                ratios[s].append(r["tokens_per_s"] / this[ref]["tokens_per_s"])
        line = {"bench": "float8_vs_bf16", "round": rnd, "order": order, "device": args.device, "quick": args.quick,
                "compile": args.compile, "emulate": args.emulate, "steps": args.steps, "warmup": args.warmup,
                "shape": SHAPES["quick" if args.quick else "gpu"], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "runs": this}
        print(json.dumps(line), file=sys.stderr, flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(line) + "\n")
    print(f"\nlm tokens/s on {args.device}{' (quick sizes)' if args.quick else ''}, {'compiled' if args.compile else 'eager'}, "
          f"{args.steps} steps, medians over {len(got[ref])} round(s)")
    print(f"| side | tokens/s | vs {ref} | loss after {args.steps} steps | loss vs {ref} | warm-up s |\n|---|---|---|---|---|---|")
    ref_loss = [r["loss"] for r in got[ref] if r.get("loss") is not None]
    failed = 0
    for s in sides:
        ok = [r for r in got[s] if r.get("tokens_per_s")]
        if not ok:
            print(f"| {s} | failed: {got[s][-1].get('error') if got[s] else 'not run'} | | | | |")
            failed += 1
            continue
        loss = statistics.median(r["loss"] for r in ok)
        rel = f"{loss / statistics.median(ref_loss) - 1:+.2%}" if ref_loss else "?"
        print(f"| {s} | {statistics.median(r['tokens_per_s'] for r in ok):,.0f} | {statistics.median(ratios[s]):.3f}x | "
              f"{loss:.4f} | {rel} | {statistics.median(r['warmup_s'] for r in ok):.1f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
