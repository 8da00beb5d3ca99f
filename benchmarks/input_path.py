"""The input path at dtrain's defaults (issue 28, item 4): the data wait on a JPEG folder with the
default DataLoader workers against none, `dtrain train --task images` on one process.

The folder is the test suite's (``tests.support.images.write_digit_folder``: digits as JPEGs,
decoded and augmented per sample). Rounds alternate the order of the two sides; the table gives
the medians of samples/s (steady state) and of the data wait (per step, and its share of the
training time).

    python benchmarks/input_path.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")


def run(folder: str, workers: int | None, args: argparse.Namespace, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "dtrain", "train", "--task", "images", "--data-dir", folder, "--task-arg", f"size={args.size}",
           "--task-arg", "model=resnet18", "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
           "--log-every", str(args.steps), "--device", "cpu", *([] if workers is None else ["--num-workers", str(workers)])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {proc.stderr[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: res[k] for k in ("samples_per_s", "warmup_s", "data_wait_ms", "data_wait_share", "num_workers", "data_first_wait_ms")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--size", type=int, default=64, help="pixels the images are resized to")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sys.path.insert(0, SRC)
    sys.path.insert(0, os.path.dirname(HERE))  # tests.support: the harness that only tests and benchmarks use
    from tests.support.images import write_digit_folder

    folder = str(write_digit_folder(tempfile.mkdtemp(prefix="dtrain-jpeg-"), size=32, train_per_class=40))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (SRC, os.environ.get("PYTHONPATH"))))}
    sides = {"default workers": None, "0 workers": 0}
    got: dict[str, list[dict]] = {s: [] for s in sides}
    for rnd in range(args.rounds):
        order = list(sides) if rnd % 2 == 0 else list(reversed(sides))
        this = {s: run(folder, sides[s], args, env) for s in order}
        for s, r in this.items():
            got[s].append(r)
        line = {"round": rnd, "order": order, "load1": round(os.getloadavg()[0], 2), "runs": this}
        print(json.dumps(line), file=sys.stderr, flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(line) + "\n")
    print(f"\nJPEG folder, resnet18 at {args.size} px, batch {args.batch_size}, {args.steps} steps, {args.rounds} round(s), medians")
    print("| side | workers | samples/s | data wait ms/step | data wait share |\n|---|---|---|---|---|")
    for s, rows in got.items():
        print(f"| {s} | {rows[0]['num_workers']} | {statistics.median(r['samples_per_s'] for r in rows):.1f} | "
              f"{statistics.median(r['data_wait_ms'] for r in rows):.2f} | {statistics.median(r['data_wait_share'] for r in rows):.1%} |")


if __name__ == "__main__":
    main()
