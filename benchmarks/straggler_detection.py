"""Straggler detection on 2 ranks: does ``dtrain train`` name the slowed rank and the right cause,
and stay quiet on healthy runs? Each trial runs three jobs, interleaved: one rank's loader slowed
by a sleep (``DTRAIN_SLOW_INJECT=R:input:MS``; expected cause input), one rank's process given a
CPU-hogging thread of matrix products (``R:hog``; expected cause compute), and a healthy run. The
slowed rank alternates between 0 and 1 across trials.

    python3 benchmarks/straggler_detection.py --trials 5 --steps 100 --window 50 --sleep-ms 10
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES = {"input": "input", "hog": "compute", "healthy": None}


def run_job(args: argparse.Namespace, inject: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")}
    env.pop("DTRAIN_SLOW_INJECT", None)
    if inject:
        env["DTRAIN_SLOW_INJECT"] = inject
    cmd = [sys.executable, "-m", "dtrain", "train", "-n", "2", "--task", args.task, "--max-steps", str(args.steps),
           "--log-every", str(args.log_every), "--straggler-window", str(args.window), "--straggler-threshold", str(args.threshold)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise SystemExit(f"job failed ({inject}): {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--threshold", type=float, default=1.3)
    p.add_argument("--sleep-ms", type=float, default=10.0)
    p.add_argument("--task", default="digits")
    args = p.parse_args()
    tally = {c: {"runs": 0, "named": 0, "right_rank": 0, "right_cause": 0, "false_reports": 0, "first_step": []} for c in CASES}
    for trial in range(args.trials):
        slow = trial % 2
        for case, cause in CASES.items():
            inject = {"input": f"{slow}:input:{args.sleep_ms:g}", "hog": f"{slow}:hog", "healthy": None}[case]
            result = run_job(args, inject)
            found = result.get("stragglers") or []
            t = tally[case]
            t["runs"] += 1
            if cause is None:
                t["false_reports"] += bool(found)
            else:
                mine = [s for s in found if s["rank"] == slow]
                t["named"] += bool(found)
                t["right_rank"] += bool(mine)
                t["right_cause"] += bool(mine) and mine[0]["cause"] == cause
                t["false_reports"] += any(s["rank"] != slow for s in found)
                if mine:
                    t["first_step"].append(mine[0]["step"])
            print(json.dumps({"trial": trial, "case": case, "slow_rank": slow if cause else None,
                              "stragglers": [(s["rank"], s["cause"], s["ratio"], s["step"]) for s in found],
                              "samples_per_s": result.get("samples_per_s")}), flush=True)
    print(f"2 ranks, {args.task}, {args.steps} steps, window {args.window}, threshold {args.threshold}, loader sleep {args.sleep_ms:g} ms:")
    for case, t in tally.items():
        print(f"  {case:8s} runs {t['runs']}: named {t['named']}, right rank {t['right_rank']}, right cause {t['right_cause']}, "
              f"false reports {t['false_reports']}, first named at steps {t['first_step']}")


if __name__ == "__main__":
    main()
