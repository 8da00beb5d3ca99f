"""Each call's time of a gloo all-gather of 128 KiB and 1 MiB on a shaped 2-host bed link, call by call:
the links probe keeps the median of 3 at 1 MiB, and on the bed's links that call takes one of two modes
(issue 31: FSDP's predictions followed whichever the probe caught).

    python benchmarks/allgather_modes.py [--rate 100] [--calls 15] [--out FILE]

(root, ``ip netns``). Prints one JSON line: ms per call, after a barrier each, the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bed_pair import on_bed  # noqa: E402


def worker(rank: int, master: str, port: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2)
    out = {}
    for size in (128 << 10, 1 << 20):
        t = torch.ones(size // 4)
        part = t[: t.numel() // 2].clone()
        times = []
        for _ in range(calls):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_gather_into_tensor(t, part)
            times.append((time.perf_counter() - t0) * 1e3)
        v = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        out[size] = [round(x, 1) for x in v.tolist()]
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--calls", type=int, default=15)
    p.add_argument("--port", type=int, default=29991)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        r, m, port, calls = args.worker
        worker(int(r), m, int(port), int(calls))
        return
    ms = on_bed(lambda r, m: [sys.executable, os.path.abspath(__file__), "--worker", str(r), m, str(args.port), str(args.calls)],
                args.rate, 300, "allgather_modes")
    row = {"date": time.strftime("%Y-%m-%d %H:%M"), "rate_mbit": args.rate, "ms_per_call": ms}
    print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
