"""Horovod's two PyTorch elastic examples, unmodified, on ``dtrain.compat.horovod``: each runs
under ``dtrain run -n N --max-restarts 1``, one worker is killed (SIGKILL) once training is under
way, and the job must finish.

    python benchmarks/horovod_elastic.py --examples PATH/examples/elastic/pytorch --mnist-dir DIR

Fetches nothing: PATH is a copy of horovod/horovod's ``examples/elastic/pytorch`` folder (the
script runs ``pytorch_mnist_elastic.py`` and ``pytorch_synthetic_benchmark_elastic.py`` from it)
and DIR holds MNIST's four ``*-ubyte.gz`` files (unpacked into a temporary ``MNIST/raw`` folder,
where torchvision looks, so its ``download=True`` finds them and downloads nothing). The
examples import ``horovod.torch``: the thin shim of ``benchmarks/horovod_suite.py`` points it at
``dtrain.compat.horovod``.

Per example it prints: exit status, seconds from start to the kill, from the kill to the resumed
workers' first line, and to the end, the commit it resumed from, and the example's last lines.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from horovod_suite import SRC, write_shim  # noqa: E402

sys.path.insert(0, str(SRC))
from dtrain.testing.procs import LaunchedJob  # noqa: E402

EXAMPLES = {
    # name: (file, arguments, a stdout line that says training is under way, how many of them)
    "mnist": ("pytorch_mnist_elastic.py", ["--epochs", "1", "--no-cuda", "--log-interval", "20"], "Train Epoch", 4),
    "synthetic": ("pytorch_synthetic_benchmark_elastic.py",
                  ["--model", "resnet18", "--batch-size", "8", "--num-warmup-batches", "2",
                   "--num-batches-per-iter", "2", "--num-iters", "6", "--no-cuda"], "Iter #", 2),
}


def unpack_mnist(src: Path, root: Path) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        with gzip.open(src / f"{name}.gz") as f_in, open(raw / name, "wb") as f_out:
            shutil.copyfileobj(f_in, f_out)


def worker_of_rank(job: LaunchedJob, rank: int) -> psutil.Process | None:
    for p in job.descendants():
        try:
            if "dtrain.launch.worker" in " ".join(p.cmdline()) and p.environ().get("RANK") == str(rank):
                return p
        except psutil.Error:
            continue
    return None


def run_example(name: str, examples: Path, work: Path, n: int, kill_rank: int, timeout: float) -> dict:
    file, extra, marker, count = EXAMPLES[name]
    if name == "mnist":
        extra = [*extra, "--data-dir", str(work / "data")]
    out = work / name
    out.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([str(work), str(SRC)])}
    args = ["run", "-n", str(n), "--max-restarts", "1", str(examples / file), *extra]
    start = time.monotonic()
    result: dict = {"example": file, "args": extra, "nproc": n}
    with LaunchedJob(args, out_dir=str(out), env=env, cwd=str(work)) as job:
        job.wait_for(lambda: job.stdout().count(marker) >= count, timeout=timeout)
        victim = worker_of_rank(job, kill_rank)
        if victim is None:
            raise SystemExit(f"{name}: no worker of rank {kill_rank} found")
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        result["kill_after_s"] = round(killed - start, 1)
        job.wait_for(lambda: "resumes from commit" in job.stderr(), timeout=timeout)
        result["resumed_after_kill_s"] = round(time.monotonic() - killed, 1)
        rc, _ = job.wait(timeout)
        result["exit"] = rc
        result["total_s"] = round(time.monotonic() - start, 1)
        lines = [line for line in job.stderr().splitlines() if "hvd.elastic" in line]
        result["elastic_lines"] = [line[:240] for line in lines]
        result["last_stdout"] = job.stdout().strip().splitlines()[-3:]
        if rc != 0:
            result["stderr_tail"] = job.stderr()[-3000:]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", required=True, type=Path, help="a copy of Horovod's examples/elastic/pytorch folder")
    p.add_argument("--mnist-dir", type=Path, default=None, help="MNIST's *-ubyte.gz files (for the mnist example)")
    p.add_argument("--only", choices=sorted(EXAMPLES), action="append", help="run only this example (repeatable)")
    p.add_argument("-n", type=int, default=2)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    names = args.only or sorted(EXAMPLES)
    for name in names:
        if not (args.examples / EXAMPLES[name][0]).is_file():
            print(f"horovod_elastic: error: {args.examples / EXAMPLES[name][0]} does not exist; give --examples "
                  "a copy of Horovod's examples/elastic/pytorch folder.", file=sys.stderr)
            return 2
    if "mnist" in names and not (args.mnist_dir and (args.mnist_dir / "train-images-idx3-ubyte.gz").is_file()):
        print(f"horovod_elastic: error: --mnist-dir {args.mnist_dir} has no train-images-idx3-ubyte.gz; give the "
              "folder with MNIST's four .gz files, or --only synthetic.", file=sys.stderr)
        return 2
    report = []
    with tempfile.TemporaryDirectory(prefix="hvd-elastic-") as tmp:
        work = Path(tmp)
        write_shim(work)
        if "mnist" in names:
            unpack_mnist(args.mnist_dir, work / "data")
        for name in names:
            res = run_example(name, args.examples.resolve(), work, args.n, args.kill_rank, args.timeout)
            report.append(res)
            print(json.dumps(res, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if all(r["exit"] == 0 for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
