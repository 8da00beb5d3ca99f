"""What compression costs in accuracy, across seeds: MNIST for one epoch on 2 ranks (loopback; the
link does not change the arithmetic), plain DDP against PowerSGD at ranks 1 and 2, per seed.

A single seeded run says little about a 0.3-point goal: seed-to-seed spread of plain DDP alone
is of that order. Each seed trains every method from the same initial weights and data order,
so the per-seed difference is the compression's own effect.

    flock /tmp/dtrain-bench.lock python benchmarks/comm_accuracy_seeds.py --data-dir ../shared/data/mnist --seeds 0,1,2,3,4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def train(data_dir: str, seed: int, comm: str, warmup: int, timeout: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "dtrain", "train", "--task", "mnist", "--data-dir", data_dir, "--epochs", "1",
           "-n", "2", "--seed", str(seed), "--comm", comm, "--comm-warmup", str(warmup), "--log-every", "1000000"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"dtrain train failed (seed {seed}, --comm {comm}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def seed_list(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 0,1,2") from None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--seeds", type=seed_list, default="0,1,2,3,4")
    p.add_argument("--modes", default="none,powersgd:1,powersgd:2")
    p.add_argument("--warmup", type=int, default=8, help="plain steps first (auto's warm-up length)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default=str(HERE / "results" / f"comm_accuracy_seeds-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"))
    a = p.parse_args()
    seeds = a.seeds
    modes = a.modes.split(",")
    if "none" not in modes:
        raise SystemExit("--modes must include none (the reference).")
    acc: dict[tuple[int, str], float] = {}
    with open(a.out, "w") as f:
        for seed in seeds:
            for mode in modes:
                r = train(a.data_dir, seed, mode, a.warmup, a.timeout)
                acc[seed, mode] = r["test_acc"]
                f.write(json.dumps({"seed": seed, "mode": mode, "test_acc": r["test_acc"],
                                    "samples_per_s": r["samples_per_s"], "steps": r["steps"]}) + "\n")
                f.flush()
                print(f"seed {seed} {mode:12s} test acc {r['test_acc']:.4f}", flush=True)
    for mode in modes:
        if mode == "none":
            continue
        diffs = [round(100 * (acc[s, mode] - acc[s, "none"]), 2) for s in seeds]
        print(f"{mode}: points vs none per seed {diffs}; median {statistics.median(diffs):+.2f}, "
              f"worst {min(diffs):+.2f}", flush=True)
    print(f"rows: {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
