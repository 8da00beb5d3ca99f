"""What `dtrain train --micro-batch auto` costs on a CPU: the plan's proposal (in the launching
process) and the trials that confirm it (in the workers), in seconds and in trials, for the lm task.

A CPU does not run out of memory at these sizes, so the smaller device is rank 1's fake one
(``DTRAIN_OOM_INJECT=1:BYTES``, ``dtrain.train.microbatch.Budget``): BYTES is set here halfway
between what the trials of the target micro-batch and of the next larger one would hold (the
parameters and their gradients, the optimizer state reserved for the first step, the tensors saved
for backward, counted as the Budget counts them). Each case also runs without --micro-batch auto
(at the --grad-accum the search settles on) for the run's wall time beside it.

    python3 benchmarks/micro_batch_auto.py [--repeats 2] [--out benchmarks/results/micro_batch_auto-DATE.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

BATCH = 32
STEPS = 5
#: (processes, the micro-batch rank 1's fake device lets fit; None: no fake device)
CASES = ((1, None), (2, None), (2, 8), (2, 1))


def saved_bytes(task, m: int) -> int:
    """Bytes the forward of ``m`` samples saves for backward, parameters left out (as ``Budget`` counts)."""
    import torch

    model = task.new_model()
    x, y = next(iter(torch.utils.data.DataLoader(task.train_set, batch_size=m)))
    seen, total = {id(p) for p in model.parameters()}, [0]

    def pack(t):
        base = t._base if t._base is not None else t
        if id(base) not in seen:
            seen.add(id(base))
            total[0] += base.numel() * base.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        task.loss_fn(model(x), y).backward()
    return total[0]


def budget_for(target: int, nproc: int) -> int:
    """Rank 1's fake device: ``target`` samples per micro-step fit, the next divisor up does not."""
    from dtrain.cli.microbatch import with_proposal
    from dtrain.tasks import load_task
    from dtrain.train.config import BatchConfig, TaskConfig, TrainConfig
    from dtrain.train.microbatch import AutoMicro, divisors

    task = load_task("lm")
    params = sum(p.numel() * p.element_size() for p in task.new_model().parameters())
    cfg = with_proposal(TrainConfig(task=TaskConfig(name="lm"), batch=BatchConfig(size=BATCH, micro=AutoMicro())), nproc, "cpu")
    resident = 2 * params + cfg.batch.micro.reserve_bytes
    up = next(d for d in divisors(BATCH) if d > target)
    return int(resident + (saved_bytes(task, target) + saved_bytes(task, up)) / 2)


def train(nproc: int, extra: list[str], env: dict[str, str]) -> tuple[dict, str, float]:
    cmd = [sys.executable, "-m", "dtrain", "train", "--task", "lm", "-n", str(nproc), "--batch-size", str(BATCH),
           "--max-steps", str(STEPS), "--log-every", "100", *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), **env})
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr, wall


def one(nproc: int, target: int | None) -> dict:
    env = {"DTRAIN_OOM_INJECT": f"1:{budget_for(target, nproc)}"} if target is not None else {}
    auto, err, wall = train(nproc, ["--micro-batch", "auto"], env)
    line = next((ln for ln in err.splitlines() if "--micro-batch auto:" in ln), "")
    proposal_s = re.search(r"by the plan in ([\d.]+) s", line)
    plain, _, plain_wall = train(nproc, ["--grad-accum", str(auto["grad_accum"])], {})
    return {"processes": nproc, "batch": BATCH, "fake_device": env.get("DTRAIN_OOM_INJECT"), "micro_batch": auto["micro_batch"],
            "grad_accum": auto["grad_accum"], "trials": len(auto["micro_batch_trials"]), "tried": auto["micro_batch_trials"],
            "retries": sum(not ok for _, ok in auto["micro_batch_trials"]), "search_s": auto["micro_batch_search_s"],
            "step_ms_fixed_accum": _step_ms(plain), "samples_per_s_auto": auto["samples_per_s"],
            "samples_per_s_fixed_accum": plain["samples_per_s"],
            "proposal_s": float(proposal_s.group(1)) if proposal_s else None, "wall_s_auto": round(wall, 2),
            "wall_s_fixed_accum": round(plain_wall, 2), "train_loss_auto": auto["train_loss"], "train_loss_fixed": plain["train_loss"],
            "line": line}


def _step_ms(result: dict) -> float | None:
    """Rank 0's median step (after the first) in the run at the settled accumulation: what a trial is compared with."""
    breakdown = result.get("breakdown") or []
    return breakdown[0]["median_ms"]["step"] if breakdown else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", f"micro_batch_auto-{datetime.date.today()}.jsonl"))
    args = ap.parse_args()
    head = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "task": "lm", "batch": BATCH, "steps": STEPS}
    print(json.dumps(head), flush=True)
    rows = [head]
    for _ in range(args.repeats):
        for nproc, target in CASES:
            row = one(nproc, target)
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
