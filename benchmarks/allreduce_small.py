"""How long small gloo collectives take on a bed link, timed three ways (issue 31: the links'
all-reduce latency is fitted from the 64-byte time, which moved 0.9-3.7 ms between bed runs).

On 2 bed hosts (one process each), the slowest rank's time of: a 64-byte all-reduce, a 64-byte
broadcast and a 256 KiB all-reduce, each ``after_barrier`` (the links probe's way: median of 15; ``_b``: the same again; ``after_barrier_mean``, ``_mean_b``: the
mean of 15, twice; ``after_barrier_min``/``_max``: the fastest and slowest of 15), ``back_to_back`` (30 in a row, mean) and ``after_sleep5ms`` (a barrier, 5 ms idle,
then the op; median). ``--sessions K``: K fresh worlds (and beds) per link, one row each: whether a
world keeps the speed it starts with.

    python benchmarks/allreduce_small.py --rates 1000,100 [--sessions 4]

(root, ``ip netns``). One JSON line per link (``--out``) and a table (ms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bed_pair import on_bed  # noqa: E402

HOW = ("after_barrier", "after_barrier_b", "after_barrier_mean", "after_barrier_mean_b", "after_barrier_min", "after_barrier_max",
       "back_to_back", "after_sleep5ms")


def worker(rank: int, master: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2)
    small, big = torch.ones(16), torch.ones(1 << 16)

    def timed(op, reps=15, idle=0.0):
        op()
        times = []
        for _ in range(reps):
            dist.barrier()
            if idle:
                time.sleep(idle)
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        return times

    def after_barrier(op, reps=15, idle=0.0):
        return statistics.median(timed(op, reps, idle))

    def back_to_back(op, reps=30):
        op()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            op()
        return (time.perf_counter() - t0) / reps

    ways = {"after_barrier": after_barrier, "after_barrier_min": lambda op: min(timed(op)), "after_barrier_max": lambda op: max(timed(op)),
            "after_barrier_mean": lambda op: statistics.mean(timed(op)), "after_barrier_mean_b": lambda op: statistics.mean(timed(op)),
            "after_barrier_b": after_barrier,
            "back_to_back": back_to_back, "after_sleep5ms": lambda op: after_barrier(op, idle=0.005)}
    out = {}
    for name, op in (("all_reduce 64 B", lambda: dist.all_reduce(small)), ("broadcast 64 B", lambda: dist.broadcast(small, 0)),
                     ("all_reduce 256 KiB", lambda: dist.all_reduce(big))):
        for how in HOW:
            v = torch.tensor([ways[how](op)], dtype=torch.float64)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            out[f"{name}, {how}"] = round(v.item() * 1e3, 3)
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", nargs=3, metavar=("RANK", "MASTER", "PORT"), help=argparse.SUPPRESS)
    p.add_argument("--rates", default="1000,100", help="Mbit/s of the bed links, comma-separated")
    p.add_argument("--port", type=int, default=29951)
    p.add_argument("--sessions", type=int, default=1, help="fresh worlds per link (one row each)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        worker(int(args.worker[0]), args.worker[1], int(args.worker[2]))
        return
    rows = []
    runs = [(rate, k) for rate in (float(r) for r in args.rates.split(",")) for k in range(args.sessions)]
    for i, (rate, k) in enumerate(runs):
        ms = on_bed(lambda r, m, i=i: [sys.executable, os.path.abspath(__file__), "--worker", str(r), m, str(args.port + i)],
                    rate, 300, "allreduce_small")
        row = {"rate_mbit": rate, "session": k, "ms": ms, "load1": round(os.getloadavg()[0], 2)}
        rows.append(row)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    names = list(rows[0]["ms"])
    print("| link | " + " | ".join(names) + " | load |\n|---|" + "---|" * len(names) + "---|")
    for r in rows:
        print(f"| {r['rate_mbit']:g} Mbit/s ({r.get('session', 0)}) | " + " | ".join(str(r["ms"][k]) for k in names) + f" | {r['load1']} |")


if __name__ == "__main__":
    main()
