"""The stall watchdog: (1) time from the start of a stall to the printed report and the exit,
for given timeouts; (2) its cost per step on MNIST, as a ratio in one run (watchdog on/off,
alternating, medians).

    python benchmarks/watchdog.py --timeouts 10 60 --rounds 3 --max-steps 150
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STALL = os.path.join(HERE, "..", "tests", "scripts", "stall.py")
DATA = os.path.join(HERE, "..", "..", "shared", "data", "mnist")


def stall_latency(timeout: int) -> tuple[float, float]:
    """Seconds from the stall's start to the report line, and to the launcher's exit."""
    proc = subprocess.Popen([sys.executable, "-m", "dtrain", "run", "-n", "2", "--stall-timeout", str(timeout), STALL, "sleep", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    slept = None
    for line in proc.stdout:
        m = re.search(r"sleeping since ([0-9.]+)", line)
        if m:
            slept = float(m.group(1))
            break
    reported = None
    for line in proc.stderr:
        if "dtrain: stall:" in line and reported is None:
            reported = time.time()
    proc.wait(timeout=timeout + 120)
    ended = time.time()
    assert slept and reported and proc.returncode == 124, proc.returncode
    return reported - slept, ended - slept


def samples_per_s(stall_timeout: str, max_steps: int) -> float:
    r = subprocess.run([sys.executable, "-m", "dtrain", "train", "--task", "mnist", "--data-dir", DATA, "-n", "2",
                        "--max-steps", str(max_steps), "--stall-timeout", stall_timeout],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["samples_per_s"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--timeouts", type=int, nargs="+", default=[10, 60])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=150)
    args = p.parse_args()
    for t in args.timeouts:
        rep, end = stall_latency(t)
        print(f"stall timeout {t} s: report after {rep:.1f} s, exit after {end:.1f} s (timeout + {end - t:.1f} s)", flush=True)
    on, off = [], []
    for _ in range(args.rounds):
        on.append(samples_per_s("900", args.max_steps))
        off.append(samples_per_s("0", args.max_steps))
        print(f"  watchdog on {on[-1]:.1f}  off {off[-1]:.1f} samples/s", flush=True)
    ratios = [a / b for a, b in zip(on, off)]
    print(f"MNIST {args.max_steps} steps x {args.rounds} rounds: watchdog on {statistics.median(on):.1f}, off {statistics.median(off):.1f} "
          f"samples/s; on/off median of paired ratios {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
