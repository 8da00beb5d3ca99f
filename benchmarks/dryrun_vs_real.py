"""`dtrain dry-run` against a real run of the same configuration.

For each strategy: rank 0 of a dry run of world N (the fake process group, the model built on the
meta device; `dtrain dry-run --json` in a process of its own) against rank 0 of a real N-process
gloo run of `dtrain train`'s program (the model built whole on the CPU, as `dtrain train` does),
both measured by the same tracker (``dtrain.dryrun.track``: the tensors' peak, the collectives of
each step). Then the wall time of a large world (``--big``, e.g. 512) on this CPU.

    python3 benchmarks/dryrun_vs_real.py --strategies fsdp,ddp -n 2 --big 512 --out benchmarks/results/53-dryrun-DATE.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def real_rank(args: list[str]) -> dict:
    """One rank of the real run (spawned by ``run_distributed``): `dtrain dry-run`'s own flags
    parsed into its config, run on the gloo group this process joins, the model built eagerly."""
    from dtrain.cli import build_parser
    from dtrain.cli.dryrun import config_from_args
    from dtrain.dryrun import run_rank
    from dtrain.dryrun.track import summarise
    from dtrain.world import World

    cfg = config_from_args(build_parser().parse_args(["dry-run", *args]))
    world = World.detect(device="cpu")
    run = run_rank(cfg, world, materialize="eager")
    return {"peak_mib": run.peak_bytes / 2**20, "state_mib": sum(run.state.values()) / 2**20,
            "collectives": summarise(run.steps[-1]), "losses": run.losses}


def dry(args: list[str]) -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "dtrain", "dry-run", "--json", *args], capture_output=True, text=True,
                         cwd=ROOT, check=False)
    wall = time.perf_counter() - t0
    if out.returncode not in (0, 1):
        raise SystemExit(f"dry run failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]), wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default="fsdp,ddp")
    p.add_argument("-n", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--task", default="lm")
    p.add_argument("--task-arg", action="append", default=[])
    p.add_argument("--big", type=int, default=512, help="world size of the timing run (0: none)")
    p.add_argument("--out", default=None, help="markdown file to write the table to")
    a = p.parse_args()
    from dtrain.launch.local import run_distributed

    rows = []
    extra = [f"--task-arg={t}" for t in a.task_arg]
    for strategy in a.strategies.split(","):
        flags = ["--task", a.task, *extra, "--strategy", strategy, "--steps", str(a.steps), "--device", "cpu", "--no-predict"]
        rec, dry_s = dry([*flags, "-n", str(a.n)])
        real = run_distributed(real_rank, [*flags, "-n", str(a.n)], world_size=a.n, timeout=900)[0]
        same = rec["collectives"] == real["collectives"]
        rows.append({"strategy": strategy, "world": a.n, "dry_peak_mib": rec["peak_mib"], "real_peak_mib": round(real["peak_mib"], 2),
                     "peak_ratio": round(rec["peak_mib"] / real["peak_mib"], 4), "dry_state_mib": rec["state_mib"],
                     "real_state_mib": round(real["state_mib"], 2), "collectives_equal": same,
                     "dry_collectives": rec["collectives"], "real_collectives": real["collectives"], "dry_wall_s": round(dry_s, 1)})
        print(json.dumps(rows[-1]), flush=True)
    big = None
    if a.big:
        rec, wall = dry(["--task", a.task, *extra, "-n", str(a.big), "--strategy", "fsdp", "--device", "cpu"])
        big = {"world": a.big, "wall_s": round(wall, 1), "peak_mib": rec["peak_mib"], "state_mib": rec["state_mib"],
               "predicted": rec["predicted"], "collectives": rec["collectives"]}
        print(json.dumps(big), flush=True)
    if a.out:
        write(a, rows, big)


def write(a: argparse.Namespace, rows: list[dict], big: dict | None) -> None:
    load = open("/proc/loadavg").read().split()[:3]
    lines = [f"# dtrain dry-run against a real run ({time.strftime('%Y-%m-%d')})", "",
             f"Machine: the development VM (2 cores, shared), load {' '.join(load)} at the end. "
             f"Command: `python3 benchmarks/dryrun_vs_real.py --strategies {a.strategies} -n {a.n} --steps {a.steps} --big {a.big}`", "",
             "| strategy | world | dry peak MiB | real peak MiB | dry / real | dry state MiB | real state MiB | collectives equal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['world']} | {r['dry_peak_mib']} | {r['real_peak_mib']} | {r['peak_ratio']} | "
                     f"{r['dry_state_mib']} | {r['real_state_mib']} | {r['collectives_equal']} |")
    lines += ["", "Collectives per step (rank 0):", ""]
    for r in rows:
        lines.append(f"- {r['strategy']}: dry {r['dry_collectives']}; real {r['real_collectives']}")
    if big:
        lines += ["", f"World {big['world']} (`dtrain dry-run --task {a.task} -n {big['world']} --strategy fsdp --device cpu`): "
                  f"**{big['wall_s']} s** wall, peak {big['peak_mib']} MiB, state {big['state_mib']} MiB, "
                  f"predicted {big['predicted']}, collectives {big['collectives']}"]
    with open(a.out, "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
