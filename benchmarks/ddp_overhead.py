"""dtrain's overhead against a plain PyTorch DDP script on the same MNIST workload.

Runs `dtrain train --task mnist -n 2` and `torchrun --nproc-per-node 2 plain_ddp_mnist.py`
alternately, ROUNDS times each, and prints the median samples/s of each and their ratio.

    python benchmarks/ddp_overhead.py --data-dir ../shared/data/mnist --rounds 5 --max-steps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=str(HERE.parent.parent / "shared" / "data" / "mnist"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("-n", "--nproc", type=int, default=2)
    p.add_argument("--plain-bucket-view", action="store_true", help="give the plain script dtrain's gradient_as_bucket_view=True")
    p.add_argument("--plain-bucket-cap-mb", type=float, default=None,
                   help="give the plain script an explicit bucket_cap_mb (dtrain passes 25, which also sizes DDP's first bucket)")
    a = p.parse_args()
    steps = ["--max-steps", str(a.max_steps)]
    cmds = {
        "dtrain": [sys.executable, "-m", "dtrain", "train", "--task", "mnist", "--data-dir", a.data_dir,
                   "-n", str(a.nproc), "--log-every", "1000000", *steps],
        "plain": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc),
                  str(HERE / "plain_ddp_mnist.py"), "--data-dir", a.data_dir, *steps,
                  *(["--gradient-as-bucket-view"] if a.plain_bucket_view else []),
                  *(["--bucket-cap-mb", str(a.plain_bucket_cap_mb)] if a.plain_bucket_cap_mb is not None else [])],
    }
    rates: dict[str, list[float]] = {k: [] for k in cmds}
    for i in range(a.rounds):
        order = list(cmds) if i % 2 == 0 else list(reversed(cmds))  # alternate who goes first
        for name in order:
            r = subprocess.run(cmds[name], capture_output=True, text=True, check=True)
            rates[name].append(last_json(r.stdout)["samples_per_s"])
            print(f"round {i + 1} {name:6s} {rates[name][-1]:8.1f} samples/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratios = [d / p for d, p in zip(rates["dtrain"], rates["plain"])]
    print(json.dumps({"median_samples_per_s": med, "ratio_of_medians": round(med["dtrain"] / med["plain"], 4),
                      "median_of_paired_ratios": round(statistics.median(ratios), 4), "rounds": a.rounds,
                      "max_steps": a.max_steps, "nproc": a.nproc, "plain_bucket_view": a.plain_bucket_view,
                      "plain_bucket_cap_mb": a.plain_bucket_cap_mb}))


if __name__ == "__main__":
    main()
