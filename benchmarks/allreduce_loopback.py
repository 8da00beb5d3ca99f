"""Small gloo collectives between 2 processes over loopback (no bed, no shaping): the share of calls
that take the slow mode seen on the bed (issue 31: a 64-byte all-reduce at 0.3-0.7 ms or ~3 ms).

Each of all_reduce, broadcast, all_gather and reduce_scatter of 16 float32 elements, ``--calls``
times after a barrier; rank 0's percentiles (ms) and the share of calls over 2 ms.

    python benchmarks/allreduce_loopback.py [--calls 200] [--port 29993]
"""

from __future__ import annotations

import argparse
import os
import time


def _q(times: list[float], p: float) -> float:
    times = sorted(times)
    return round(times[int(p * (len(times) - 1))] * 1e3, 3)


def worker(rank: int, port: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    t = torch.ones(16)
    ops = {"all_reduce": lambda: dist.all_reduce(t), "broadcast": lambda: dist.broadcast(t, 0),
           "all_gather": lambda: dist.all_gather_into_tensor(torch.empty(32), t),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(8), t)}
    for name, op in ops.items():
        op()
        times = []
        for _ in range(calls):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"{name}: p10 {_q(times, .1)} p50 {_q(times, .5)} p75 {_q(times, .75)} p90 {_q(times, .9)} ms; "
                  f"over 2 ms: {sum(x > 2e-3 for x in times) / calls:.0%}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--port", type=int, default=29993)
    args = p.parse_args()
    mp.spawn(worker, args=(args.port, args.calls), nprocs=2)


if __name__ == "__main__":
    main()
