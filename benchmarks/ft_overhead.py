"""The step time of a fault-tolerant job without failures against the same job without fault
tolerance, on this host: `dtrain train --nproc 2` (DDP, one process group) and `dtrain train
--fault-tolerance --nproc 2` (2 replica groups on torchft), same task, batch and steps; the median
of the per-step times read from --metrics-file (`--log-every 1`: consecutive records' wall_s),
after the first 10 steps, over ``--repeats`` alternating runs.

    python3 benchmarks/ft_overhead.py --task digits --repeats 3 --json benchmarks/results/ft_overhead-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def step_times(path: str, replica: str | None) -> list[float]:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    if replica is not None:
        rows = [r for r in rows if r.get("replica") == replica]
    rows = [r for r in rows if r["step"] > 10]
    return [b["wall_s"] - a["wall_s"] for a, b in zip(rows, rows[1:]) if b["step"] == a["step"] + 1]


def one(ft: bool, task: list[str], steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        cmd = [sys.executable, "-m", "dtrain", "train", "--nproc", "2", *task, "--max-steps", str(steps), "--epochs", "100",
               "--metrics-file", metrics, "--log-every", "1", *(["--fault-tolerance"] if ft else [])]
        env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
        return statistics.median(step_times(metrics, "0-0" if ft else None))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="digits")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    task = ["--task", a.task]
    plain, ft = [], []
    for _ in range(a.repeats):
        plain.append(one(False, task, a.steps))
        ft.append(one(True, task, a.steps))
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, this host",
           "command": " ".join(["python3", "benchmarks/ft_overhead.py", *sys.argv[1:]]),
           "step_s_plain": [round(x, 4) for x in plain], "step_s_ft": [round(x, 4) for x in ft],
           "speed_ft_vs_plain": round(statistics.median(plain) / statistics.median(ft), 3)}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
