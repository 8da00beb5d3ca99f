"""Time from a frozen worker (SIGSTOP, tests/scripts/freeze.py) to the job's exit, or to the first
step of the restarted workers (--max-restarts 1), with a given --stall-timeout. ``--src`` picks the
dtrain source tree to time (e.g. an older checkout for the before/after comparison).

    python benchmarks/frozen_worker.py --stall-timeout 15 --rounds 3 [--restart] [--src /work/main/src]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FREEZE = os.path.join(HERE, "..", "tests", "scripts", "freeze.py")


def one(src: str, timeout: float, restart: bool) -> float:
    """Seconds from the freeze to the launcher's exit, or to the restarted workers' first step."""
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, "-m", "dtrain", "run", "-n", "2", "--stall-timeout", str(timeout),
           "--run-dir", tempfile.mkdtemp(prefix="dtrain-frozen-"), FREEZE]
    if restart:
        cmd[4:4] = ["--max-restarts", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    frozen = first = None
    for line in proc.stdout:
        if m := re.search(r"frozen at ([0-9.]+)", line):
            frozen = float(m.group(1))
        if (m := re.search(r"restarted, first step at ([0-9.]+)", line)) and first is None:
            first = float(m.group(1))
    proc.wait(timeout=600)
    ended = time.time()
    assert frozen is not None, "the worker never froze"
    if restart:
        assert first is not None and proc.returncode == 0, f"no restart (exit {proc.returncode})"
        return first - frozen
    assert proc.returncode == 124, f"exit {proc.returncode}"
    return ended - frozen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stall-timeout", type=float, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--restart", action="store_true", help="time the first step of the restart, not the exit")
    ap.add_argument("--src", default=os.path.join(HERE, "..", "src"))
    args = ap.parse_args()
    times = []
    for i in range(args.rounds):
        t = one(os.path.abspath(args.src), args.stall_timeout, args.restart)
        times.append(t)
        print(f"round {i + 1}: {t:.1f} s", flush=True)
    what = "first step after restart" if args.restart else "job exit"
    print(f"freeze -> {what}, --stall-timeout {args.stall_timeout:g}, src {args.src}: "
          f"median {statistics.median(times):.1f} s, runs {', '.join(f'{t:.1f}' for t in times)}")


if __name__ == "__main__":
    main()
