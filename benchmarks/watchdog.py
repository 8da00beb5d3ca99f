"""The stall watchdog: (1) time from the start of a stall to the printed report and the exit,
for given timeouts; (2) its cost per step on MNIST, as a ratio in one run (watchdog on/off,
alternating, medians); (3) what its bookkeeping costs per step in isolation (a loader heartbeat,
the backward recorded as a collective, the optimizer step's heartbeat), against the MNIST step.

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
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STALL = os.path.join(HERE, "..", "tests", "scripts", "stall.py")
DATA = os.path.join(HERE, "..", "..", "shared", "data", "mnist")


def stall_latency(timeout: int) -> tuple[float, float]:
    """Seconds from the stall's start to the report line, and to the launcher's exit."""
    run_dir = tempfile.mkdtemp(prefix="dtrain-stall-")  # stack dumps and the report land here
    proc = subprocess.Popen([sys.executable, "-m", "dtrain", "run", "-n", "2", "--stall-timeout", str(timeout), "--run-dir", run_dir,
                             STALL, "sleep", "1"],
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


def bookkeeping_us_per_step(n: int = 20000) -> float:
    """Median over 5 repeats of the per-step bookkeeping the watchdog needs, in microseconds."""
    import contextlib

    import torch

    from dtrain.diag import Tracker

    tracker, loss = Tracker(), torch.zeros(())

    @contextlib.contextmanager
    def collective(op, *tensors):  # as Context._collective records one
        call = tracker.enter(op, *tensors)
        try:
            yield
        finally:
            tracker.leave(call)

    def step() -> None:
        tracker.beat()  # the loader's batch
        with collective("backward (gradient all-reduce)", loss):
            pass
        tracker.beat(tracker.step + 1)  # the optimizer step

    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--timeouts", type=int, nargs="+", default=[10, 60])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=150)
    p.add_argument("--no-stall", action="store_true", help="skip the stall-latency part")
    args = p.parse_args()
    for t in [] if args.no_stall else args.timeouts:
        rep, end = stall_latency(t)
        print(f"stall timeout {t} s: report after {rep:.1f} s, exit after {end:.1f} s (timeout + {end - t:.1f} s)", flush=True)
    on, off = [], []
    for i in range(args.rounds):  # ABBA: which side runs first alternates, so a drifting load favours neither
        first_on = i % 2 == 0
        a = samples_per_s("900" if first_on else "0", args.max_steps)
        b = samples_per_s("0" if first_on else "900", args.max_steps)
        on.append(a if first_on else b)
        off.append(b if first_on else a)
        print(f"  round {i + 1} ({'on first' if first_on else 'off first'}): watchdog on {on[-1]:.1f}  off {off[-1]:.1f} samples/s, "
              f"on/off {on[-1] / off[-1]:.3f}", flush=True)
    ratios = [a / b for a, b in zip(on, off)]
    print(f"MNIST {args.max_steps} steps x {args.rounds} rounds: watchdog on {statistics.median(on):.1f}, off {statistics.median(off):.1f} "
          f"samples/s; on/off median of paired ratios {statistics.median(ratios):.3f}")
    us = bookkeeping_us_per_step()
    step_us = 64 * 2 / statistics.median(off) * 1e6  # mnist: batch 64 per rank, 2 ranks
    print(f"bookkeeping {us:.1f} us/step = {us / step_us * 100:.3f}% of the MNIST step ({step_us / 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
