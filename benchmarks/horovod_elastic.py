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

``--join-and-loss PORT`` runs dtrain's own test script (``tests/scripts/hvd_elastic.py``) on two
launchers on 127.0.0.1 with ``--nnodes 1:2``: node A starts alone, node B joins (A's worker stops
at its next commit, both resume from it at size 2), then node B is killed (A resumes alone from
the newest commit); it checks that every sample of each epoch was trained on exactly once.
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
sys.path.insert(0, str(SRC.parent))  # tests.support: the harness that only tests and benchmarks use
from tests.support.procs import LaunchedJob  # noqa: E402

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


def join_and_loss(port: int, work: Path, timeout: float, samples: int = 4096) -> dict:
    script = SRC.parent / "tests" / "scripts" / "hvd_elastic.py"
    common = ["run", "--nnodes", "1:2", "-n", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--rdzv-last-call", "2", "--rdzv-id", "hvd-elastic", str(script)]
    (work / "A").mkdir()
    (work / "B").mkdir()
    start = time.monotonic()
    res: dict = {"samples": samples}
    with LaunchedJob([*common, str(work / "A.json"), "--samples", str(samples)], out_dir=str(work / "A")) as a:
        time.sleep(20)  # A trains alone for a while
        with LaunchedJob([*common, str(work / "B.json"), "--samples", str(samples)], out_dir=str(work / "B")) as b:
            res["join_at_s"] = round(time.monotonic() - start, 1)
            a.wait_for(lambda: "resumes from commit" in a.stderr(), timeout=timeout)
            res["size2_after_join_s"] = round(time.monotonic() - start - res["join_at_s"], 1)
            time.sleep(10)
            res["loss_at_s"] = round(time.monotonic() - start, 1)
            b.kill_all()
        a.wait_for(lambda: a.stderr().count("resumes from commit") >= 2, timeout=timeout)
        res["size1_after_loss_s"] = round(time.monotonic() - start - res["loss_at_s"], 1)
        res["exit"], _ = a.wait(timeout)
        res["total_s"] = round(time.monotonic() - start, 1)
        res["elastic_lines"] = [line[:200] for line in a.stderr().splitlines() if "hvd.elastic" in line]
    if res["exit"] == 0:
        out = json.loads((work / "A.json").read_text())
        per_epoch = {}
        for epoch, index in out["steps"]:
            per_epoch.setdefault(epoch, []).extend(index)
        res["exactly_once_per_epoch"] = all(sorted(v) == list(range(samples)) for v in per_epoch.values())
        res["steps_by_world_size"] = {str(w): sum(1 for _, i in out["steps"] if len(i) == 4 * w) for w in (1, 2)}
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=Path, default=None, help="a copy of Horovod's examples/elastic/pytorch folder")
    p.add_argument("--join-and-loss", type=int, default=None, metavar="PORT",
                   help="instead: two launchers on 127.0.0.1:PORT, a node joins then is lost (dtrain's own script)")
    p.add_argument("--samples", type=int, default=4096,
                   help="with --join-and-loss: samples per epoch (enough that the job outlasts the join and the loss)")
    p.add_argument("--mnist-dir", type=Path, default=None, help="MNIST's *-ubyte.gz files (for the mnist example)")
    p.add_argument("--only", choices=sorted(EXAMPLES), action="append", help="run only this example (repeatable)")
    p.add_argument("-n", type=int, default=2)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.join_and_loss is not None:
        with tempfile.TemporaryDirectory(prefix="hvd-elastic-") as tmp:
            res = join_and_loss(args.join_and_loss, Path(tmp), args.timeout, args.samples)
        print(json.dumps(res, indent=1))
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
        return 0 if res["exit"] == 0 and res.get("exactly_once_per_epoch") else 1
    if args.examples is None:
        p.error("give --examples PATH (or --join-and-loss PORT)")
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
