"""--batch-split speed against even on 2 ranks of unequal CPU speed (issue 54, item 1).

Each rank is its own `dtrain train` process (torchrun's environment, set here), pinned to its own
core (taskset), with one torch thread; the slow rank's process is put in a cgroup v1 cpu
controller group with a CFS quota (``--quota 50``: 50 ms of CPU per 100 ms period, half a core).
Each round runs even and speed on both sides (rank 1 slowed, then rank 0), the order of even and
speed alternating, and with ``--alone`` each rank's own rate with one process on its core at the
same per-rank batch (the sum of the two is what a perfect split would reach). The figure is the
run's steady samples/s (after ``--warmup-steps``, which covers the split's measurement).
Medians over rounds; every run is one JSON line in ``--out``, with the load average before
and after it (the machine is shared), and each rank's median step breakdown over the run
(``breakdown_ms``: where the throttled rank's step goes, the all-reduce's ``comm`` included).

    python benchmarks/batch_split.py --task lm --rounds 3 --out benchmarks/results/batch_split-DATE.jsonl

Needs root (the cgroup); Linux with cgroup v1's cpu controller at /sys/fs/cgroup/cpu.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
TASKS = {
    "lm": ["--task", "lm", "--task-arg", "layers=2", "--task-arg", "width=128", "--task-arg", "heads=4",
           "--task-arg", "context=64", "--batch-size", "16"],
    "images": ["--task", "images", "--task-arg", "source=synthetic", "--task-arg", "size=32", "--batch-size", "16"],
}


class Quota:
    """A cgroup v1 cpu group with a CFS quota (percent of one core); removed on exit."""

    def __init__(self, percent: int) -> None:
        self.path = CPU_CGROUP / f"dtrain-bench-{os.getpid()}"
        self.path.mkdir(exist_ok=True)
        (self.path / "cpu.cfs_period_us").write_text("100000")
        (self.path / "cpu.cfs_quota_us").write_text(str(percent * 1000))

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (CPU_CGROUP / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        self.path.rmdir()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: argparse.Namespace, quota: Quota, *, world: int, slow: int | None, split: str) -> dict:
    """One training run of ``world`` ranks (rank r on core r); ``slow``: the rank under the quota."""
    port, procs = _free_port(), []
    base = [sys.executable, "-m", "dtrain", "train", *TASKS[args.task], "--max-steps", str(args.steps), "--warmup-steps",
            str(args.warmup), "--log-every", str(args.steps), "--num-workers", "0"]
    if world > 1:
        base += ["--batch-split", split]
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        core = rank if world > 1 else (slow if slow is not None else 0)
        p = subprocess.Popen(["taskset", "-c", str(core), *base], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        if (world > 1 and rank == slow) or (world == 1 and slow is not None):
            quota.add(p.pid)
        procs.append(p)
    outs = [p.communicate(timeout=args.timeout) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"run failed ({split}, slow rank {slow}):\n{outs[0][1][-2000:]}\n{outs[-1][1][-2000:]}")
    result = json.loads(outs[0][0].strip().splitlines()[-1])
    lines = [ln.split("batch split: ", 1)[1] for ln in outs[0][1].splitlines() if "batch split: " in ln]
    # Each rank's median phase times (ms) over the run: where the step goes, per rank.
    per_rank = [((w or {}).get("median_ms") or {}) for w in (result.get("breakdown") or [])]
    breakdown = [{k: round(v, 1) for k, v in m.items() if v is not None} for m in per_rank]
    return {"samples_per_s": result["samples_per_s"], "steps": result["steps"], "split_lines": lines, "breakdown_ms": breakdown}


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="lm", choices=sorted(TASKS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=15, help="steps left out of the rate (the split is measured at step 5)")
    ap.add_argument("--quota", type=int, default=50, help="the slow rank's CPU quota, percent of one core")
    ap.add_argument("--alone", action="store_true", help="also each rank's own rate, one process on its core")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = open(args.out, "a") if args.out else None
    quota = Quota(args.quota)
    rows: list[dict] = []
    try:
        for rnd in range(args.rounds):
            for slow in (1, 0):
                modes = ["even", "speed"] if (rnd + slow) % 2 == 0 else ["speed", "even"]
                plan = [(2, m) for m in modes] + ([(1, "alone-fast"), (1, "alone-slow")] if args.alone else [])
                for world, mode in plan:
                    load0 = _load()
                    t0 = time.time()
                    slowed = slow if mode != "alone-fast" else None
                    rec = _run(args, quota, world=world, slow=slowed, split=mode)
                    row = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "task": args.task,
                           "round": rnd, "mode": mode, "slow_rank": slow, "quota_percent": args.quota, **rec,
                           "wall_s": round(time.time() - t0, 1), "loadavg_before": load0, "loadavg_after": _load()}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if out:
                        out.write(json.dumps(row) + "\n")
                        out.flush()
    finally:
        quota.close()
    summary = {m: statistics.median(r["samples_per_s"] for r in rows if r["mode"] == m)
               for m in ("even", "speed", "alone-fast", "alone-slow") if any(r["mode"] == m for r in rows)}
    if "even" in summary and "speed" in summary:
        summary["speed_over_even"] = round(summary["speed"] / summary["even"], 3)
    if "alone-fast" in summary:
        summary["speed_over_sum_alone"] = round(summary["speed"] / (summary["alone-fast"] + summary["alone-slow"]), 3)
    print(json.dumps({"summary": summary, "task": args.task, "rounds": args.rounds}), flush=True)
    if out:
        out.write(json.dumps({"summary": summary, "task": args.task, "rounds": args.rounds}) + "\n")


if __name__ == "__main__":
    main()
