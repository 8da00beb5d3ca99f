"""--comm over a slow link: MNIST, 1 epoch, 2 hosts x 1 process on the network test bed
(`tests.support.netbed`), each mode with the link shaped to RATE Mbit/s and unshaped.

For each mode: samples/s (training loop, as `dtrain train` reports it, warm-up included),
shaped/unshaped ratio, test accuracy, and auto's choice. Goal (issue 4): auto over the shaped
link >= 95% of the samples/s of `none` over the unshaped link, accuracy within 0.3 points.
Runs alternate shaped and unshaped per mode; every result is appended to a JSON-lines file as
it comes, so an interrupted run keeps what it measured. Needs root and iproute2.

    flock /tmp/dtrain-bench.lock python benchmarks/comm_slow_link.py --data-dir ../shared/data/mnist

``--goal-pairs N`` measures only the goal: N pairs of (auto over the shaped link, none over the
unshaped link), alternating which goes first, and prints each pair's ratio and the medians.

    flock /tmp/dtrain-bench.lock python benchmarks/comm_slow_link.py --data-dir ../shared/data/mnist --goal-pairs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, SRC)
sys.path.insert(0, os.path.dirname(HERE))  # tests.support: the harness that only tests and benchmarks use

from tests.support.netbed import NetBed  # noqa: E402

MODES = ("none", "auto", "fp16", "bf16", "powersgd:2", "localsgd:16")


def run_once(mode: str, rate: float | None, args: argparse.Namespace, port: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": str(args.threads)}
    extra = ["--max-steps", str(args.max_steps)] if args.max_steps else []
    with NetBed(rate_mbit=rate) as bed:
        outs = bed.run_nodes(lambda r, master: [
            sys.executable, "-m", "dtrain", "train", "--task", "mnist", "--data-dir", args.data_dir, "--epochs", "1",
            "--comm", mode, "--nnodes", "2", "--node-rank", str(r), "--master-addr", master, "--master-port", str(port),
            "--log-every", "100", *extra], timeout=args.timeout, env=env)
    if any(o.returncode != 0 for o in outs):
        tail = "\n".join(f"node {o.node_rank} (status {o.returncode}):\n{o.output[-1500:]}" for o in outs)
        raise RuntimeError(f"{mode} at {rate} Mbit/s failed:\n{tail}")
    result = json.loads(next(line for line in reversed(outs[0].output.splitlines()) if line.startswith("{")))
    auto = next((line.split("dtrain: ", 1)[-1] for line in outs[0].output.splitlines() if "--comm auto:" in line), None)
    return {"mode": mode, "rate_mbit": rate, "samples_per_s": result["samples_per_s"], "test_acc": result["test_acc"],
            "steps": result["steps"], "comm_choice": result.get("comm_choice"), "wall_s": result["wall_s"], "auto_line": auto}


def table(rows: list[dict], rate: float) -> str:
    by = {(r["mode"], r["rate_mbit"]): r for r in rows}
    base = by.get(("none", None))
    lines = [f"| --comm | samples/s unshaped | samples/s at {rate:g} Mbit/s | shaped / unshaped | shaped / none unshaped "
             "| test acc unshaped | test acc shaped | choice (shaped) |", "|---|---|---|---|---|---|---|---|"]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        u, s = by.get((mode, None)), by.get((mode, rate))
        f = lambda r, k, fmt: format(r[k], fmt) if r and r.get(k) is not None else "-"  # noqa: E731
        ratio = f"{s['samples_per_s'] / u['samples_per_s']:.2f}" if s and u else "-"
        vs_base = f"{s['samples_per_s'] / base['samples_per_s']:.2f}" if s and base else "-"
        lines.append(f"| {mode} | {f(u, 'samples_per_s', '.0f')} | {f(s, 'samples_per_s', '.0f')} | {ratio} | {vs_base} "
                     f"| {f(u, 'test_acc', '.4f')} | {f(s, 'test_acc', '.4f')} | {(s or {}).get('comm_choice') or '-'} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-steps", type=int, default=None, help="shorter runs (default: the whole epoch)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each host's process (default 1: 2 hosts on 2 cores)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--goal-pairs", type=int, default=0, metavar="N",
                   help="only the goal: N pairs of auto shaped vs none unshaped, alternating; medians")
    p.add_argument("--out", default=os.path.join(HERE, "results", f"comm_slow_link-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"))
    args = p.parse_args()
    args.data_dir = os.path.abspath(args.data_dir)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    if args.goal_pairs:
        return goal_pairs(args)
    rows = []
    port = 29600
    for i, mode in enumerate(args.modes.split(",")):
        rates = (args.rate_mbit, None) if i % 2 else (None, args.rate_mbit)  # alternate which side goes first
        for rate in rates:
            port += 1
            row = run_once(mode, rate, args, port)
            rows.append(row)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    print(table(rows, args.rate_mbit))
    return 0


def goal_pairs(args: argparse.Namespace) -> int:
    """Auto over the shaped link against none over the unshaped one, ``--goal-pairs`` times."""
    port, ratios, accs = 29700, [], []
    for i in range(args.goal_pairs):
        sides = [("auto", args.rate_mbit), ("none", None)]
        pair = {}
        for mode, rate in (sides if i % 2 == 0 else sides[::-1]):
            port += 1
            row = {**run_once(mode, rate, args, port), "pair": i}
            pair[mode] = row
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
        ratios.append(pair["auto"]["samples_per_s"] / pair["none"]["samples_per_s"])
        accs.append(pair["auto"]["test_acc"] - pair["none"]["test_acc"])
        print(f"pair {i}: auto shaped {pair['auto']['samples_per_s']:.0f} samples/s ({pair['auto']['comm_choice']}) / "
              f"none unshaped {pair['none']['samples_per_s']:.0f} = {ratios[-1]:.3f}; "
              f"test acc {pair['auto']['test_acc']:.4f} vs {pair['none']['test_acc']:.4f}", flush=True)
    print(f"median ratio {statistics.median(ratios):.3f} (pairs: {', '.join(f'{r:.3f}' for r in ratios)}); "
          f"median accuracy difference {100 * statistics.median(accs):+.2f} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
