"""Fault injection: K runs of `dtrain train -n 2 --max-restarts 2`, each killing a random rank
(SIGKILL) right after a random step; every run must complete and end bitwise equal to an
uninterrupted reference run. Reports runs completed, runs equal, and steps redone per failure.

    python benchmarks/fault_injection.py --runs 5 --save-every 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests.support.faults: the fault driver (a dtrain train plugin), which only tests and benchmarks use


def dtrain(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtrain", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=900)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=2026)
    args = p.parse_args()
    from tests.support import faults

    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="dtrain-faults-")
    common = ["train", "--task", "digits", "-n", "2", "--epochs", str(args.epochs), "--save-every", str(args.save_every)]
    ref = dtrain(*common, "--checkpoint-dir", f"{work}/ref")
    assert ref.returncode == 0, ref.stderr[-2000:]
    total = json.loads(ref.stdout.strip().splitlines()[-1])["steps"]
    rows = []
    for i in range(args.runs):
        rank, step = rng.randrange(2), rng.randrange(1, total)
        t0 = time.perf_counter()
        r = dtrain(*common, "--checkpoint-dir", f"{work}/run{i}", "--max-restarts", "2", env=faults.env(rank, step))
        wall = time.perf_counter() - t0
        m = re.search(r"resumed from .* at step (\d+)", r.stderr)
        resumed = int(m.group(1)) if m else 0
        equal = r.returncode == 0 and dtrain("ckpt", "diff", f"{work}/ref", f"{work}/run{i}").returncode == 0
        rows.append({"run": i, "killed_rank": rank, "killed_after_step": step, "completed": r.returncode == 0,
                     "resumed_at": resumed, "steps_redone": step - resumed, "bitwise_equal": equal, "wall_s": round(wall, 1)})
        print(json.dumps(rows[-1]), flush=True)
    done = sum(r["completed"] for r in rows)
    same = sum(r["bitwise_equal"] for r in rows)
    worst = max(r["steps_redone"] for r in rows)
    print(f"\n{total} steps per run, save every {args.save_every}: {done}/{len(rows)} completed, {same}/{len(rows)} bitwise equal "
          f"to the reference, steps redone per failure max {worst} (mean {sum(r['steps_redone'] for r in rows) / len(rows):.1f})")


if __name__ == "__main__":
    main()
