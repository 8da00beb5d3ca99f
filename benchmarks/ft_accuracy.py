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

``--curve-every S`` also saves every S committed steps (``--save-every S``, every checkpoint kept)
and, after the run, scores each checkpoint on the test set here (the groups are replicas: one model
per step): the run's curve of the metric by step and by epochs of samples seen. The summary then
gives, per task, the medians at each whole epoch (the like-for-like comparison by samples seen) and
at equal committed steps (the killed run's curve at the unkilled run's last step); the
checkpoints are deleted once scored.

    python3 benchmarks/ft_accuracy.py --tasks mnist,lm --seeds 0,1,2 --steps 200 --kills 3 --json FILE
    python3 benchmarks/ft_accuracy.py --tasks mnist,lm --seeds 0,1,2 --epochs 2 --mnist-samples 6000 --kills 3 --json FILE
    python3 benchmarks/ft_accuracy.py --tasks mnist --seeds 0,1,2 --epochs 12 --mnist-samples 6000 --kills 2 --curve-every 46 --json FILE
    python3 benchmarks/ft_accuracy.py --tasks lm --seeds 0,1 --epochs 20 --lm-lr 3e-3 --kills 2 --curve-every 70 --json FILE
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
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


def task_of(chosen: list[str], a: argparse.Namespace):
    """The Task a run trains (through the CLI's own loader), to score its checkpoints here."""
    from dtrain.tasks import load_task
    spec = chosen[chosen.index("--task") + 1]
    options = dict(v.split("=", 1) for k, v in zip(chosen, chosen[1:]) if k == "--task-arg")
    return load_task(spec, data_dir=a.data_dir if "mnist" in spec else None, options=options)


def curve(task, folder: str) -> list[dict]:
    """Every step saved under ``folder`` (any group's: equal steps hold equal models), scored on the
    test set as the run's own end does: step, epochs of samples seen (epoch + position / n), metric."""
    import glob

    import torch
    from torch.utils.data import DataLoader
    paths = {}
    for path in sorted(glob.glob(f"{folder}/replica-*/step-*/state.pt")):
        paths.setdefault(int(path.split("step-")[-1].split("/")[0]), path)
    model, out = task.new_model(), []
    for step in sorted(paths):
        state = torch.load(paths[step], map_location="cpu", weights_only=False)
        model.load_state_dict(state["objects"]["model"])
        model.eval()
        total = count = 0.0
        with torch.no_grad():
            for x, y in DataLoader(task.test_set, batch_size=256):
                total, count = total + task.metric(model(x).float(), y).double().sum().item(), count + len(y)
        order = state["objects"]["order"]
        out.append({"step": step, "epochs": round(order["epoch"] + order["pos"] / order["n"], 4),
                    "metric": round(total / count, 6)})
    return out


def at(points: list[dict], key: str, x: float) -> float:
    """The metric at ``x`` (``key``: "step" or "epochs") on a curve: linear between its checkpoints,
    the end's value past the end (a job's last save is a few samples short of a whole epoch)."""
    pts = sorted((p[key], p["metric"]) for p in points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y1 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[0][1] if x < pts[0][0] else pts[-1][1]


def _ready(rows: list[dict], target: int) -> bool:
    return bool(rows) and rows[-1]["step"] >= target and rows[-1]["participants"] == 2


def one(task: str, seed: int, steps: int, kills: int, rng: random.Random, a: argparse.Namespace) -> dict:
    """One run; ``steps``: the job's length (``--epochs``: the unkilled run's steps, where the kills are drawn)."""
    tmp = tempfile.mkdtemp(prefix="ft_accuracy-")
    metrics = Tail(f"{tmp}/m.jsonl")
    chosen = TASKS[task]
    if task == "mnist" and a.mnist_samples:
        chosen = ["--task", "benchmarks.ft_accuracy:mnist_subset", "--task-arg", f"n={a.mnist_samples}"]
    if task == "lm" and a.lm_lr:
        chosen = [*chosen, "--lr", str(a.lm_lr)]
    length = ["--epochs", str(a.epochs)] if a.epochs else ["--max-steps", str(steps), "--epochs", "100"]
    args = ["train", "--fault-tolerance", "min=1,heartbeat=1", "--nproc", "2", "--max-restarts", str(kills + 2), *chosen,
            *(["--data-dir", a.data_dir] if task == "mnist" else []),
            "--seed", str(seed), *length, "--metrics-file", f"{tmp}/m.jsonl",
            "--log-every", "1", "--ledger", f"{tmp}/ledger",
            # a group restarted after its peer finished reads there that the job ended (else it waits 60 s and fails)
            "--checkpoint-dir", f"{tmp}/ckpt",
            *(["--save-every", str(a.curve_every), "--keep", "100000"] if a.curve_every else [])]
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
    points = curve(task_of(chosen, a), f"{tmp}/ckpt") if a.curve_every else None
    if a.curve_every:
        shutil.rmtree(f"{tmp}/ckpt", ignore_errors=True)  # hundreds of MB a run
    epochs = report.epochs if report else []
    return {"task": task, "seed": seed, "kills": len(done), "killed_at_steps": done, "exit": code,
            "metric": key, "values": [r.get(key) for r in results], "steps": [r.get("steps") for r in results],
            "not_committed": [r["fault_tolerance"]["steps_not_committed"] for r in results],
            "ledger_exactly_once": bool(report and report.ok and not disagree),
            "ledger_epochs_complete": sum(e.complete and e.exactly_once for e in epochs), "ledger_epochs": len(epochs),
            "ledger_steps": report.steps_kept if report else None, "load1": round(os.getloadavg()[0], 2), "folder": tmp,
            **({"curve": points} if points is not None else {})}


def like_for_like(rows: list[dict], task: str, epochs: int) -> dict:
    """From the curves: per whole epoch (equal samples seen) the unkilled and killed medians and
    their difference; and each killed run at its seed's unkilled run's last step (equal steps)."""
    runs = [r for r in rows if r["task"] == task and r.get("curve")]
    pairs = [(u, k) for u in runs for k in runs if u["seed"] == k["seed"] and not u["kills"] and k["kills"]]
    by_epoch = []
    for e in range(1, epochs + 1):
        u, k = ([round(at(r["curve"], "epochs", e), 5) for r in runs if (r["kills"] > 0) == side] for side in (False, True))
        if u and k:
            by_epoch.append({"epoch": e, "unkilled": u, "killed": k, "unkilled_spread": round(max(u) - min(u), 5),
                             "killed_minus_unkilled": round(statistics.median(k) - statistics.median(u), 5)})
    steps = [{"seed": u["seed"], "step": u["curve"][-1]["step"], "unkilled": u["curve"][-1]["metric"],
              "killed": round(at(k["curve"], "step", u["curve"][-1]["step"]), 5)} for u, k in pairs]
    diff = statistics.median(s["killed"] - s["unkilled"] for s in steps) if steps else None
    # a plateau's last checkpoint jitters (lm: +-0.03 between neighbours): each run's mean over its last 3 epochs too
    tail = {side: [round(statistics.mean(at(r["curve"], "epochs", e) for e in range(max(1, epochs - 2), epochs + 1)), 5)
                   for r in runs if (r["kills"] > 0) == side] for side in (False, True)}
    last3 = None
    if tail[False] and tail[True]:
        last3 = {"unkilled": tail[False], "killed": tail[True], "unkilled_spread": round(max(tail[False]) - min(tail[False]), 5),
                 "killed_minus_unkilled": round(statistics.median(tail[True]) - statistics.median(tail[False]), 5)}
    return {"by_epoch": by_epoch, "equal_steps": steps, "last3_epochs_mean": last3,
            "equal_steps_killed_minus_unkilled": round(diff, 5) if diff is not None else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="mnist,lm")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--epochs", type=int, default=0, help="run this many epochs instead of --steps steps")
    p.add_argument("--mnist-samples", type=int, default=0, help="MNIST on its first N training images (0: all)")
    p.add_argument("--lm-lr", type=float, default=0, help="lm's learning rate (0: the task's, AdamW 1e-3)")
    p.add_argument("--data-dir", default=os.path.join(ROOT, "..", "shared", "data", "mnist"))
    p.add_argument("--curve-every", type=int, default=0,
                   help="save every N steps and score each checkpoint: the metric's curve (0: the end only)")
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
        if a.curve_every:
            summary[task].update(like_for_like(rows, task, a.epochs))
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
