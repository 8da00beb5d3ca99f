"""ResNet-18 images/s of `dtrain train --task images` against plain_ddp_images.py (torchrun + DDP +
torchvision, no dtrain): same model, batch, transforms, DataLoader workers and steps, 2 processes,
alternating which side goes first; and (--sweep) dtrain's data-wait share and images/s on the
folder source at its default worker count and at each given --num-workers.

The folder is MNIST digits written as RGB JPEGs of --file-size pixels (tests.support.images),
cropped to --size: real decoding and augmentation, nothing downloaded.

    python benchmarks/images_vs_plain.py --rounds 3 --size 64 --max-steps 30
    python benchmarks/images_vs_plain.py --sweep 0,1,2,3 --rounds 2 --size 64 --max-steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MNIST = HERE.parent.parent / "shared" / "data" / "mnist"


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def _children_cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def run(cmd: list[str]) -> dict:
    """Run one side; its result line plus ``cpu_s`` (user+sys seconds of all its processes,
    start-up included) and the 1-minute load average when it ended."""
    before = _children_cpu_s()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return {**last_json(r.stdout), "cpu_s": round(_children_cpu_s() - before, 1), "load1": os.getloadavg()[0]}


def folder(a: argparse.Namespace) -> Path:
    sys.path.insert(0, str(HERE.parent / "src"))
    sys.path.insert(0, str(HERE.parent))  # tests.support: the harness that only tests and benchmarks use
    from tests.support.images import write_digit_folder

    root = Path(a.work) / f"digits-{a.file_size}px-{a.per_class}"
    if not (root / "train").exists():
        write_digit_folder(root, train_per_class=a.per_class, val_per_class=0, size=a.file_size, mnist_dir=MNIST)
    return root


def commands(a: argparse.Namespace, source: str, data: Path) -> dict[str, list[str]]:
    n, steps, batch, workers = str(a.nproc), str(a.max_steps), str(a.batch_size), str(a.workers)
    src = ["--task-arg", "source=synthetic"] if source == "synthetic" else ["--data-dir", str(data)]
    plain_src = ["--synthetic"] if source == "synthetic" else ["--data-dir", str(data)]
    return {
        "dtrain": [sys.executable, "-m", "dtrain", "train", "--task", "images", *src, "--task-arg", f"size={a.size}",
                   "-n", n, "--batch-size", batch, "--max-steps", steps, "--num-workers", workers, "--log-every", "1000000"],
        "plain": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", n, str(HERE / "plain_ddp_images.py"),
                  *plain_src, "--size", str(a.size), "--batch-size", batch, "--max-steps", steps, "--workers", workers],
    }


def compare(a: argparse.Namespace, data: Path) -> None:
    for source in a.sources.split(","):
        cmds = commands(a, source, data)
        rates: dict[str, list[float]] = {k: [] for k in cmds}
        cpu: dict[str, list[float]] = {k: [] for k in cmds}
        for i in range(a.rounds):
            for name in (list(cmds) if i % 2 == 0 else list(reversed(cmds))):  # alternate who goes first
                r = run(cmds[name])
                rates[name].append(r["samples_per_s"])
                cpu[name].append(r["cpu_s"])
                print(f"{source} round {i + 1} {name:6s} {rates[name][-1]:8.2f} images/s, cpu {r['cpu_s']:6.1f} s, "
                      f"load {r['load1']:.1f}", flush=True)
        med = {k: statistics.median(v) for k, v in rates.items()}
        paired = [d / p for d, p in zip(rates["dtrain"], rates["plain"])]
        print(json.dumps({"source": source, "rates": rates, "cpu_s": cpu, "median_images_per_s": med,
                          "ratio_of_medians": round(med["dtrain"] / med["plain"], 4),
                          "median_of_paired_ratios": round(statistics.median(paired), 4), **_setup(a)}), flush=True)


def sweep(a: argparse.Namespace, data: Path) -> None:
    base = commands(a, "folder", data)["dtrain"]
    base = base[: base.index("--num-workers")] + base[base.index("--num-workers") + 2:]
    settings = ["default", *a.sweep.split(",")]
    rows: dict[str, list[dict]] = {s: [] for s in settings}
    for i in range(a.rounds):
        for s in (settings if i % 2 == 0 else list(reversed(settings))):
            r = run(base + ([] if s == "default" else ["--num-workers", s]))
            rows[s].append(r)
            print(f"round {i + 1} workers={s:7s} ({r['num_workers']}) {r['samples_per_s']:8.2f} images/s, "
                  f"data wait {r['data_wait_share']:.1%}, median {r['data_wait_ms']} ms/step, load {r['load1']:.1f}", flush=True)
    summary = {s: {"num_workers": v[0]["num_workers"], "median_images_per_s": statistics.median(r["samples_per_s"] for r in v),
                   "median_data_wait_share": statistics.median(r["data_wait_share"] for r in v)} for s, v in rows.items()}
    best = max(summary[s]["median_images_per_s"] for s in settings[1:])
    print(json.dumps({"sweep": summary, "default_vs_best": round(summary["default"]["median_images_per_s"] / best, 4), **_setup(a)}), flush=True)


def _setup(a: argparse.Namespace) -> dict:
    return {"nproc": a.nproc, "size": a.size, "file_size": a.file_size, "batch_size": a.batch_size,
            "max_steps": a.max_steps, "workers": a.workers, "rounds": a.rounds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=64, help="crop size fed to the model (pixels)")
    p.add_argument("--file-size", type=int, default=128, help="side of the JPEG files written (pixels)")
    p.add_argument("--per-class", type=int, default=100, help="training images per class (10 classes)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers per process, both sides")
    p.add_argument("-n", "--nproc", type=int, default=2)
    p.add_argument("--sources", default="synthetic,folder", help="comma-separated: synthetic, folder")
    p.add_argument("--sweep", default=None, help="comma-separated worker counts: run the sweep instead of the comparison")
    p.add_argument("--work", default="/tmp/dtrain-images-bench")
    a = p.parse_args()
    data = folder(a)
    sweep(a, data) if a.sweep else compare(a, data)


if __name__ == "__main__":
    main()
