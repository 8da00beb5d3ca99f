"""When each rank of a 2-host bed run starts each training step: how far local SGD's ranks drift
apart between the points where they meet (the log steps' collectives, the averaging every H steps),
against PowerSGD's, which meet every step. Issue 31: the plan under-predicts local SGD on the bed
(mlp-100m -8% to -16% in runs 18-21) and predicts its ranks' compute from the profile's medians.

    python benchmarks/localsgd_drift.py [--rate 100] [--comms localsgd:16,powersgd:2] [--log-every 10] [--reps 2]

(root, ``ip netns``). The task is dtrain's synthetic MLP (as the validation's mlp groups), its model
noting the monotonic clock (one clock for every process on this machine) at each training forward
(``make_task`` here, run as ``--task localsgd_drift:make_task``). Prints, per run, each rank's mean
and median step over steps 10-41 (the validation's window), and the lead of rank 1 over rank 0 at
each step; ``--out`` appends the raw start times as JSON lines.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def make_task(**options):
    """dtrain's synthetic task whose model notes when each training forward starts; written at exit
    to $DRIFT_DIR/rank$RANK.json."""
    import dataclasses

    import torch
    from torch import nn

    from dtrain.tasks.synthetic import make_task as synthetic

    class Noted(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner, self.starts = inner, []
            out = os.path.join(os.environ.get("DRIFT_DIR", tempfile.gettempdir()), f"rank{os.environ.get('RANK', '0')}.json")
            atexit.register(lambda: json.dump(self.starts, open(out, "w")))

        def forward(self, x):
            if torch.is_grad_enabled():
                self.starts.append(time.monotonic())
            return self.inner(x)

    known = ("hidden", "samples", "layers", "classes")
    task = synthetic(**{k: int(v) for k, v in options.items() if k in known and v is not None})
    build = task.build_model
    return dataclasses.replace(task, build_model=lambda: Noted(build()))


def summary(starts: list[list[float]], lo: int = 10) -> dict:
    n = min(len(s) for s in starts)
    steps = [[(s[i + 1] - s[i]) * 1e3 for i in range(lo, n - 1)] for s in starts]
    return {"mean_ms": [round(statistics.mean(x), 2) for x in steps], "median_ms": [round(statistics.median(x), 2) for x in steps],
            "lead_ms": [round((starts[0][i] - starts[1][i]) * 1e3, 1) for i in range(lo, n)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=100.0, help="Mbit/s of the bed link")
    p.add_argument("--comms", default="localsgd:16,powersgd:2")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--steps", type=int, default=42)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--port", type=int, default=29821)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
    sys.path.insert(0, os.path.dirname(HERE))  # tests.support: the harness that only tests and benchmarks use
    from tests.support.netbed import NetBed

    comms = args.comms.split(",")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(HERE), "src"), HERE])}
    port = args.port
    with NetBed(hosts=2, rate_mbit=args.rate) as bed:
        for rep in range(args.reps):
            for comm in comms if rep % 2 == 0 else comms[::-1]:
                port += 1
                with tempfile.TemporaryDirectory() as d:
                    outs = bed.run_nodes(lambda r, m: [
                        sys.executable, "-m", "dtrain", "train", "--task", "localsgd_drift:make_task", "--batch-size", "64",
                        "--task-arg", "hidden=512", "--task-arg", "samples=8192", "--strategy", "ddp", "--comm", comm,
                        "--comm-warmup", "2", "--max-steps", str(args.steps), "--log-every", str(args.log_every), "--nnodes", "2",
                        "--node-rank", str(r), "--master-addr", m, "--master-port", str(port)], timeout=300, env={**env, "DRIFT_DIR": d})
                    if any(o.returncode for o in outs):
                        raise SystemExit(f"{comm}: a host failed: {outs[0].output[-800:]}")
                    starts = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(2)]
                got = summary(starts)
                print(f"{comm} (run {rep + 1}): mean step per rank {got['mean_ms']} ms, median {got['median_ms']} ms; "
                      f"rank 1's lead over rank 0 at steps 10-{args.steps}: {got['lead_ms']}", flush=True)
                if args.out:
                    with open(args.out, "a") as fh:
                        fh.write(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "rate_mbit": args.rate, "comm": comm,
                                             "log_every": args.log_every, **got, "starts": starts}) + "\n")


if __name__ == "__main__":
    main()
