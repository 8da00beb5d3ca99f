"""Final test accuracy of a fault-tolerant job whose replica groups are killed, against the same job
unkilled: `dtrain train --fault-tolerance --nproc 2 --max-restarts K` on this host, per task and seed
one run left alone and one where a replica group's process (drawn at random) is killed (SIGKILL)
``--kills`` times, at steps drawn uniformly over 10-80% of the job, each after both groups are in
the quorum again (the launcher restarts a dead group 1 s later; it heals from the other's memory).
Per run: every group's final metric (test_acc; val_loss for lm), steps, steps not committed, the
ledger's verdict.

A job of ``--steps`` steps sees fewer samples when killed (while a group is out a step trains one
group's batch); ``--epochs E`` runs E epochs instead (every sample E times, checked per epoch in the
ledger), the kills drawn over the steps the same seed's unkilled run took. ``--mnist-samples N``
trains MNIST on its first N training images (the whole test set), to keep runs short.

    python3 benchmarks/ft_accuracy.py --tasks mnist,lm --seeds 0,1,2 --steps 200 --kills 3 --json FILE
    python3 benchmarks/ft_accuracy.py --tasks mnist,lm --seeds 0,1,2 --epochs 2 --mnist-samples 6000 --kills 3 --json FILE
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from ft_moments import Tail, poll_until  # noqa: E402
from tests.support.procs import LaunchedJob  # noqa: E402

from dtrain.ft.ledger import check_ft_ledger  # noqa: E402

TASKS = {"mnist": ["--task", "mnist"],
         "lm": ["--task", "lm", "--task-arg", "layers=2", "--task-arg", "width=64", "--task-arg", "max_bytes=300000"]}
"""MNIST as PyTorch's example; lm small (2 blocks of width 64, 300 kB of text: 15 kB to evaluate on), for a shared 2-core machine."""


def mnist_subset(data_dir=None, n="6000"):
    """The mnist task on its first ``n`` training images (``--task benchmarks.ft_accuracy:mnist_subset``)."""
    import dataclasses

    from torch.utils.data import TensorDataset

    from dtrain.tasks.mnist import make_task
    task = make_task(data_dir)
    return dataclasses.replace(task, train_set=TensorDataset(*(t[: int(n)] for t in task.train_set.tensors)))


def groups(job: LaunchedJob) -> list:
    """The replica groups' processes (the launcher's children, not multiprocessing's helpers)."""
    out = []
    for child in job.descendants():
        try:
            if child.ppid() == job.proc.pid and "resource_tracker" not in " ".join(child.cmdline()):
                out.append(child)
        except Exception:  # gone meanwhile
            pass
    return out


def _ready(rows: list[dict], target: int) -> bool:
    return bool(rows) and rows[-1]["step"] >= target and rows[-1]["participants"] == 2


def one(task: str, seed: int, steps: int, kills: int, rng: random.Random, a: argparse.Namespace) -> dict:
    """One run; ``steps``: the job's length (``--epochs``: the unkilled run's steps, where the kills are drawn)."""
    tmp = tempfile.mkdtemp(prefix="ft_accuracy-")
    metrics = Tail(f"{tmp}/m.jsonl")
    chosen = TASKS[task]
    if task == "mnist" and a.mnist_samples:
        chosen = ["--task", "benchmarks.ft_accuracy:mnist_subset", "--task-arg", f"n={a.mnist_samples}"]
    length = ["--epochs", str(a.epochs)] if a.epochs else ["--max-steps", str(steps), "--epochs", "100"]
    args = ["train", "--fault-tolerance", "min=1,heartbeat=1", "--nproc", "2", "--max-restarts", str(kills + 2), *chosen,
            *(["--data-dir", a.data_dir] if task == "mnist" else []),
            "--seed", str(seed), *length, "--metrics-file", f"{tmp}/m.jsonl",
            "--log-every", "1", "--ledger", f"{tmp}/ledger",
            # a group restarted after its peer finished reads there that the job ended (else it waits 60 s and fails)
            "--checkpoint-dir", f"{tmp}/ckpt"]
    at = sorted(int(rng.uniform(0.1, 0.8) * steps) for _ in range(kills))
    done = []
    with LaunchedJob(args, out_dir=tmp, cwd=ROOT, env={"PYTHONPATH": ROOT}) as job:
        for target in at:
            # the target step reached, and both groups in the last quorum (the one killed before is back)
            poll_until(lambda: job.proc.poll() is not None or _ready(metrics(), target), 600, 0.05)
            victims = groups(job)
            if len(victims) == 2 and job.proc.poll() is None:
                victim = rng.choice(victims)
                victim.send_signal(signal.SIGKILL)
                done.append(max(r["step"] for r in metrics()))
        code = job.wait(timeout=1800)[0]
        results = [json.loads(line) for line in job.stdout().splitlines() if line.startswith("{")]
    report, disagree = check_ft_ledger(f"{tmp}/ledger") if os.path.isdir(f"{tmp}/ledger") else (None, True)
    key = "val_loss" if task == "lm" else "test_acc"
    epochs = report.epochs if report else []
    return {"task": task, "seed": seed, "kills": len(done), "killed_at_steps": done, "exit": code,
            "metric": key, "values": [r.get(key) for r in results], "steps": [r.get("steps") for r in results],
            "not_committed": [r["fault_tolerance"]["steps_not_committed"] for r in results],
            "ledger_exactly_once": bool(report and report.ok and not disagree),
            "ledger_epochs_complete": sum(e.complete and e.exactly_once for e in epochs), "ledger_epochs": len(epochs),
            "ledger_steps": report.steps_kept if report else None, "load1": round(os.getloadavg()[0], 2), "folder": tmp}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="mnist,lm")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--epochs", type=int, default=0, help="run this many epochs instead of --steps steps")
    p.add_argument("--mnist-samples", type=int, default=0, help="MNIST on its first N training images (0: all)")
    p.add_argument("--data-dir", default=os.path.join(ROOT, "..", "shared", "data", "mnist"))
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rng = random.Random(2911)
    rows = []
    for task in a.tasks.split(","):
        for seed in (int(s) for s in a.seeds.split(",")):
            steps = a.steps
            for kills in (0, a.kills):
                rows.append(one(task, seed, steps, kills, rng, a))
                if a.epochs and not kills and rows[-1]["steps"] and rows[-1]["steps"][0]:
                    steps = rows[-1]["steps"][0]  # the killed run's kills are drawn over the unkilled run's steps
                print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for task in a.tasks.split(","):
        pick = {k: [r["values"][0] for r in rows if r["task"] == task and (r["kills"] > 0) == k and r["values"]] for k in (False, True)}
        summary[task] = {"unkilled": pick[False], "killed": pick[True],
                         "median_unkilled": statistics.median(pick[False]) if pick[False] else None,
                         "median_killed": statistics.median(pick[True]) if pick[True] else None}
        if pick[False] and pick[True]:
            # the verdict: killed - unkilled (medians) against the unkilled seeds' spread (max - min)
            spread = max(pick[False]) - min(pick[False])
            diff = summary[task]["median_killed"] - summary[task]["median_unkilled"]
            summary[task].update(unkilled_spread=round(spread, 5), killed_minus_unkilled=round(diff, 5),
                                 within_spread=abs(diff) <= spread)
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, this host",
           "command": " ".join(["python3", "benchmarks/ft_accuracy.py", *sys.argv[1:]]), "summary": summary, "runs": rows}
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    ok = all(r["exit"] == 0 and r["ledger_exactly_once"] and (not a.epochs or r["ledger_epochs_complete"] == a.epochs) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
