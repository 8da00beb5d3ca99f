"""The job of issue 29 on hosts that share one host name resolving to 127.0.0.1 (the network test
bed, `NetBed(shared_name="vm")`): MNIST, `--epochs 1`, `-n 1 --nnodes 1:2`, two hosts.

  plain        both hosts run the job to the end
  kill         every process of host 1 is killed (kill -9) after its 30th step at world size 2
  unreachable  host 1 alone, --master-addr 10.77.0.9 (no such host): seconds to the one-line error

Reported per run: exit statuses, wall seconds, the ledger's exactly-once verdict, seconds from the
kill to the survivor's next step, the last line of output (unreachable).

    python3 benchmarks/multinode_mnist.py plain kill unreachable --data-dir /work/shared/data/mnist
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)  # tests.support: the harness that only tests and benchmarks use

from tests.support.elastic import BedJob  # noqa: E402
from tests.support.netbed import NetBed  # noqa: E402
from tests.support.nodeloss import next_commit_after  # noqa: E402

from dtrain.data.ledger import check_ledger  # noqa: E402


def _command(data_dir: str, work: str, master: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "dtrain", "train", "--task", "mnist", "--data-dir", data_dir, "--epochs", "1", "-n", "1",
            "--nnodes", "1:2", "--master-addr", master, "--master-port", str(port), "--checkpoint-dir", os.path.join(work, "ck"),
            "--save-every", "20", "--ledger", os.path.join(work, "ledger"), "--seed", "0", *extra]


def run(bed: NetBed, mode: str, data_dir: str, port: int, startup: float | None) -> dict:
    work = tempfile.mkdtemp(prefix=f"dtrain-mnist-{mode}-")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    extra = ["--startup-timeout", str(startup)] if startup else []
    master = "10.77.0.9" if mode == "unreachable" else bed.addresses[0]
    job = BedJob(bed, lambda h: _command(data_dir, work, master, port, extra), ledger=os.path.join(work, "ledger"),
                 workdir=work, env=env, cwd=ROOT)
    out: dict = {"mode": mode, "dir": work, "load1_before": round(os.getloadavg()[0], 2)}
    start = time.time()
    if mode == "unreachable":
        job.start(1)
    else:
        job.start(0)
        job.start(1)
    if mode == "kill":
        two = job.wait_generation(2, timeout=600)
        job.wait_steps(two.number, 30, timeout=600)
        killed = job.kill(1)
    codes = job.wait(timeout=1200)
    out.update(exits=codes, wall_s=round(time.time() - start, 1), load1_after=round(os.getloadavg()[0], 2))
    if mode == "kill":
        nxt = next_commit_after(job.ledger, killed)
        out["kill_to_next_step_s"] = None if nxt is None else round(nxt - killed, 1)
    if mode == "unreachable":
        with open(job.log_path(1)) as f:
            out["last_line"] = f.read().strip().splitlines()[-1]
        out["startup_timeout_s"] = startup or 120
    else:
        report = check_ledger(job.ledger)
        out["exactly_once"] = bool(report.ok and report.epochs and all(e.complete for e in report.epochs))
        results = [json.loads(x) for x in job.logs().splitlines() if x.startswith('{"task"')]
        out["test_acc"] = results[-1].get("test_acc") if results else None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modes", nargs="+", choices=("plain", "kill", "unreachable"))
    p.add_argument("--data-dir", default="/work/shared/data/mnist")
    p.add_argument("--port", type=int, default=29761)
    p.add_argument("--startup-timeout", type=float, default=None, help="for every run (default: dtrain's, 120 s)")
    args = p.parse_args()
    with NetBed(hosts=2, shared_name="vm") as bed:
        for mode in args.modes:
            print(json.dumps(run(bed, mode, os.path.abspath(args.data_dir), args.port, args.startup_timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
