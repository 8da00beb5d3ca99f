"""Time from starting a job to its first training step: through SLURM vs. `dtrain run` directly.

Starts the private SLURM cluster of the tests (slurmctld + two slurmd emulating nodes n1, n2 on
this machine) and, alternating, runs the same 2-process digits job three ways:

  submit   `dtrain submit --slurm` (sbatch -> batch script -> srun -N2, one dtrain agent per node)
  srun     `srun -N2 --ntasks-per-node=1 dtrain train -n 1` (a job step, no batch script)
  direct   `dtrain train -n 2` (dtrain's launcher, no SLURM)

The clock starts just before the command is started and stops when rank 0's metrics file holds
the record of step 1 (`--log-every 1`), polled every 10 ms. Medians and ratios to `direct`.

    flock /tmp/dtrain-bench.lock python benchmarks/slurm_submit_overhead.py --rounds 5
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
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(SRC.parent))  # tests.support: the harness that only tests and benchmarks use

from tests.support.slurm import PrivateSlurm  # noqa: E402

DTRAIN = [sys.executable, "-m", "dtrain"]
JOB = ["train", "--max-steps", "3", "--log-every", "1"]


def first_step_s(argv: list[str], metrics: Path, env: dict, cwd: Path, timeout: float = 300) -> tuple[float, subprocess.Popen]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while time.perf_counter() - t0 < timeout:
        if metrics.exists() and metrics.read_text().strip():
            return time.perf_counter() - t0, proc
        time.sleep(0.01)
    proc.kill()
    raise RuntimeError(f"no first step after {timeout} s: {argv}")


def wait_idle(cluster: PrivateSlurm, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h"], env=cluster.env, capture_output=True, text=True).stdout
        if not out.strip():
            return
        time.sleep(0.2)
    raise RuntimeError("jobs still queued")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    times: dict[str, list[float]] = {"submit": [], "srun": [], "direct": []}
    with tempfile.TemporaryDirectory() as tmp, PrivateSlurm.start(Path(tmp) / "slurm") as cluster:
        env = {**cluster.env, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
        work = Path(tmp)
        for r in range(args.rounds):
            for how in ("submit", "srun", "direct") if r % 2 == 0 else ("direct", "srun", "submit"):
                metrics = work / f"{how}-{r}.jsonl"
                job = [*JOB, "--metrics-file", str(metrics)]
                if how == "submit":
                    argv = [*DTRAIN, "submit", "--slurm", "--name", f"b{r}", "--nodes", "2", "--dtrain-cmd", " ".join(DTRAIN),
                            "--out", str(work / f"b{r}.sbatch"), "--", "dtrain", *job]
                elif how == "srun":
                    argv = ["srun", "-N2", "--ntasks-per-node=1", *DTRAIN, *job, "-n", "1"]
                else:
                    argv = [*DTRAIN, *job, "-n", "2"]
                seconds, proc = first_step_s(argv, metrics, env, work)
                proc.wait(300)
                wait_idle(cluster)
                times[how].append(seconds)
                print(f"round {r} {how:6s} first step after {seconds:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {"rounds": args.rounds, "median_s": {k: round(v, 2) for k, v in med.items()},
              "ratio_to_direct": {k: round(v / med["direct"], 2) for k, v in med.items()},
              "all_s": {k: [round(x, 2) for x in v] for k, v in times.items()}, "load_avg": os.getloadavg()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
