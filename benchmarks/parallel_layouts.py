"""Per-rank training-state memory and tokens/s of `lm` under composed --parallel layouts vs ddp.

Runs `dtrain bench` three times (2 processes: ddp, tp=2; 4 processes: ddp, dp_shard=2,tp=2 and
more layouts; 4 processes, untied head: ddp and the PP x DP layouts) and prints, per layout, the parameter + gradient + optimizer MiB each rank holds,
its ratio to ddp's, the goal (1/tp, 1/(dp_shard x tp)), and the share of parameters that TP
leaves whole on every rank (LayerNorms, row-wise biases), by which a layout exceeds its goal
(pipeline layouts: the largest stage, as stages are cut between blocks). Usage (from the repository root):

    PYTHONPATH=src flock /tmp/dtrain-bench.lock nice -n 5 python3 benchmarks/parallel_layouts.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

TASK_ARGS = ["layers=4", "heads=4", "width=128", "context=64", "max_bytes=400000"]
RUNS = [(2, ["tp=2"], []), (4, ["dp_shard=2,tp=2", "tp=4", "dp_shard=4", "dp_replicate=2,tp=2"], []),
        # pipeline stages cannot share the tied head and embedding: these and their ddp baseline untied
        (4, ["pp=2,dp_shard=2", "pp=2,dp_replicate=2"], ["tie=false"])]


def bench(nproc: int, layouts: list[str], out: str, steps: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "dtrain", "bench", "--task", "lm", "-n", str(nproc), "--methods", "ddp",
           "--steps", str(steps), "--repeats", "3", "--warmup", "2", "--batch-size", "8", "--out", out]
    for a in TASK_ARGS + extra:
        cmd += ["--task-arg", a]
    for layout in layouts:
        cmd += ["--parallel", layout]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "report.json")) as fh:
        return json.load(fh)


def tp_whole_share() -> float:
    """Parameters that lm's TP plan leaves whole on every TP rank (LayerNorms, row-wise
    biases: what ColwiseParallel/RowwiseParallel do not split) as a share of all parameters."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from dtrain.tasks.gpt import gpt, gpt_tp_plan

    kw = dict(a.split("=") for a in TASK_ARGS if not a.startswith("max_bytes"))
    model = gpt(vocab=256, **{k: int(v) for k, v in kw.items()})
    plan = gpt_tp_plan(model, 1)
    split = {f"{m}.weight" for m, s in plan.items() if isinstance(s, (ColwiseParallel, RowwiseParallel))}
    split |= {f"{m}.bias" for m, s in plan.items() if isinstance(s, ColwiseParallel)}
    total = sum(p.numel() for p in model.parameters())
    whole = sum(p.numel() for n, p in model.named_parameters() if n not in split)
    return whole / total


def largest_stage_share(pp: int) -> float:
    """The largest pipeline stage's share of the untied model's parameters (stages are cut
    between blocks, so they are not all the same size)."""
    from dtrain.parallel.pipeline import block_bounds
    from dtrain.tasks.gpt import gpt, gpt_blocks

    kw = dict(a.split("=") for a in TASK_ARGS if not a.startswith("max_bytes"))
    model = gpt(vocab=256, tie=False, **{k: int(v) for k, v in kw.items()})
    sizes = [sum(p.numel() for p in c.parameters()) for c in model.children()]
    return max(sum(sizes[a:b]) for a, b in block_bounds(model, pp, gpt_blocks(model))) / sum(sizes)


def main() -> None:
    from dtrain.parallel import parse

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-parallel")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    share = tp_whole_share()
    print(f"lm {' '.join(TASK_ARGS)}: {share:.1%} of parameters stay whole under TP (LayerNorms, row-wise biases)")
    print("| procs | layout | state MiB/rank | vs ddp | goal | TP-aware expectation | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for i, (nproc, layouts, extra) in enumerate(RUNS):
        report = bench(nproc, layouts, os.path.join(args.out, f"run{i}-n{nproc}"), args.steps, extra)
        rows = {m["method"]: m for m in report["methods"] if "error" not in m}
        base = max(rows["ddp"]["state_mib_per_rank"])
        for name in ["ddp", *layouts]:
            m = rows.get(name if name == "ddp" else str(parse(name)))  # the report names a layout canonically
            if m is None:
                print(f"| {nproc} | {name} | failed | | | | |")
                continue
            dims = dict((k, int(v)) for k, v in (p.split("=") for p in name.split(","))) if name != "ddp" else {}
            tp, shard, pp = dims.get("tp", 1), dims.get("dp_shard", 1), dims.get("pp", 1)
            goal = 1 / (tp * shard * pp)
            # TP splits only the planned layers; FSDP all; the largest stage sets the pipeline's
            expect = ((1 - share) / tp + share) / shard * (largest_stage_share(pp) if pp > 1 else 1)
            state = max(m["state_mib_per_rank"])
            print(f"| {nproc} | {name}{' (untied)' if extra else ''} | {state:.2f} | {state / base:.3f} | {goal:.3f} | {expect:.3f} | {m['tokens_per_s']:.0f} |")


if __name__ == "__main__":
    main()
