"""The step time of a fault-tolerant job without failures against the same job without fault
tolerance, on this host, 2 processes, alternating the sides, ``--repeats`` pairs:

- ``--face train``: `dtrain train --nproc 2` (DDP) against `dtrain train --fault-tolerance --nproc 2`
  (2 replica groups on torchft), same task, batch and steps; per-step times from --metrics-file
  (`--log-every 1`: consecutive records' wall_s) after the first 10 steps. Not like for like: the
  fault-tolerant loop has no DataLoader and no per-step breakdown, the DDP one has both.
  ``--baseline-src DIR`` adds a third side: the fault-tolerant job run by another checkout's dtrain.
- ``--face script``: one loop (benchmarks/ft_overhead_loop.py: dtrain.init, ctx.setup_dataloader,
  ctx.backward, ctx.should_commit) started by `dtrain run -n 2` (DDP: its gradient all-reduce
  overlaps backward) and by `dtrain run --fault-tolerance -n 2` (torchft: a quorum per step, the
  all-reduce after backward, the commit vote); each process's step ends after optimizer.step().

The figure: per pair, the plain side's median step time over the fault-tolerant side's (>1: the
fault-tolerant job is faster); the median of the pairs.

    python3 benchmarks/ft_overhead.py --face script --task mnist --data-dir ../shared/data/mnist --repeats 5 --json FILE
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SKIP = 10
"""Warm-up steps left out of each side's median."""


def step_times(path: str, replica: str | None) -> list[float]:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    if replica is not None:
        rows = [r for r in rows if r.get("replica") == replica]
    rows = [r for r in rows if r["step"] > SKIP]
    return [b["wall_s"] - a["wall_s"] for a, b in zip(rows, rows[1:]) if b["step"] == a["step"] + 1]


def _run(cmd: list[str], src: str | None = None) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src or os.path.join(ROOT, "src"), ROOT])}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800, cwd=ROOT)


def one_train(ft: bool, a: argparse.Namespace, src: str | None = None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        data = ["--data-dir", a.data_dir] if a.data_dir else []
        _run([sys.executable, "-m", "dtrain", "train", "--nproc", "2", "--task", a.task, *data, "--max-steps", str(a.steps),
              "--epochs", "100", "--metrics-file", metrics, "--log-every", "1", *(["--fault-tolerance"] if ft else [])], src)
        return statistics.median(step_times(metrics, "0-0" if ft else None))


def one_script(ft: bool, a: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        data = ["--data-dir", a.data_dir] if a.data_dir else []
        # --fault-tolerance before -n: its optional value would take the script's path
        _run([sys.executable, "-m", "dtrain", "run", *(["--fault-tolerance"] if ft else []), "-n", "2",
              os.path.join(HERE, "ft_overhead_loop.py"), "--task", a.task, *data, "--steps", str(a.steps),
              "--batch-size", str(a.batch_size), "--out", os.path.join(tmp, "t")])
        medians = []
        for path in sorted(glob.glob(os.path.join(tmp, "t.*"))):
            stamps = [float(x) for x in open(path).read().split()][SKIP:]
            medians.append(statistics.median(b - x for x, b in zip(stamps, stamps[1:])))
        return statistics.median(medians)  # the two processes' medians


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--face", choices=("train", "script"), default="train")
    p.add_argument("--task", default="digits")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=32, help="per process (--face script)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--baseline-src", default=None,
                   help="--face train: a third side, the fault-tolerant job run by the dtrain at this src/ (e.g. a worktree of an "
                        "older commit), so that a change's effect is measured in the same pairs")
    a = p.parse_args()
    one = one_script if a.face == "script" else one_train
    plain, ft, base, loads = [], [], [], []
    sides = ("plain", "ft", "base") if a.baseline_src and a.face == "train" else ("plain", "ft")
    for i in range(a.repeats):  # alternate which side goes first
        for side in (sides if i % 2 == 0 else sides[::-1]):
            loads.append(round(os.getloadavg()[0], 2))
            if side == "base":
                base.append(one_train(True, a, a.baseline_src))
            else:
                (ft if side == "ft" else plain).append(one(side == "ft", a))
    ratios = [x / y for x, y in zip(plain, ft)]
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, this host",
           "command": " ".join(["python3", "benchmarks/ft_overhead.py", *sys.argv[1:]]), "load1": loads,
           "step_s_plain": [round(x, 4) for x in plain], "step_s_ft": [round(x, 4) for x in ft],
           "speed_ft_vs_plain_pairs": [round(r, 3) for r in ratios],
           "speed_ft_vs_plain": round(statistics.median(ratios), 3)}
    if base:
        out.update({"baseline_src": a.baseline_src, "step_s_baseline_ft": [round(x, 4) for x in base],
                    "speed_baseline_ft_vs_plain": round(statistics.median(x / y for x, y in zip(plain, base)), 3)})
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
