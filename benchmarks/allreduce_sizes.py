"""How long a gloo all-reduce of each size takes on a shaped bed link, right after a barrier (the
links probe's way) and after a barrier and an idle pause (the way a step's collectives come, after
its compute). Issue 31: the plan charges PowerSGD's 4-14 KiB all-reduces the bandwidth measured at
1 MiB, where the bed's ``tbf`` shaper lets a burst (16 KiB at 20 Mbit/s) through at once.

    python benchmarks/allreduce_sizes.py --rates 20,100 [--idle-ms 20] [--reps 15]

(root, ``ip netns``). One JSON line per link (``--out``) and a table: the median (and mean) ms per size.
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

SIZES = (64, 4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 256 << 10, 1 << 20)


def worker(rank: int, master: str, port: int, idle: float, reps: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2)
    out = {}
    for size in SIZES:
        t = torch.ones(max(1, size // 4))
        dist.all_reduce(t)
        for how, pause in (("after_barrier", 0.0), (f"after_{idle * 1e3:g}ms_idle", idle)):
            times = []
            for _ in range(reps):
                dist.barrier()
                if pause:
                    time.sleep(pause)
                t0 = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - t0)
            v = torch.tensor([statistics.median(times), statistics.mean(times)], dtype=torch.float64)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            out[f"{size} {how}"] = [round(x * 1e3, 3) for x in v.tolist()]
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--rates", default="20,100", help="Mbit/s of the bed links, comma-separated")
    p.add_argument("--idle-ms", type=float, default=20.0)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--port", type=int, default=29961)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        r, m, port, idle, reps = args.worker
        worker(int(r), m, int(port), float(idle), int(reps))
        return
    rows = []
    for i, rate in enumerate(float(r) for r in args.rates.split(",")):
        ms = on_bed(lambda r, m, i=i: [sys.executable, os.path.abspath(__file__), "--worker", str(r), m, str(args.port + i),
                                       str(args.idle_ms / 1e3), str(args.reps)], rate, 600, "allreduce_sizes")
        row = {"rate_mbit": rate, "idle_ms": args.idle_ms, "reps": args.reps, "ms_median_mean": ms, "load1": round(os.getloadavg()[0], 2)}
        rows.append(row)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    for r in rows:
        print(f"\n{r['rate_mbit']:g} Mbit/s (load {r['load1']}): ms, median (mean) of {r['reps']}")
        print("| bytes | after a barrier | after a barrier and %g ms idle | bytes / rate |\n|---|---|---|---|" % r["idle_ms"])
        for size in SIZES:
            a = r["ms_median_mean"][f"{size} after_barrier"]
            b = r["ms_median_mean"][f"{size} after_{r['idle_ms']:g}ms_idle"]
            print(f"| {size} | {a[0]} ({a[1]}) | {b[0]} ({b[1]}) | {size * 8 / (r['rate_mbit'] * 1e6) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
