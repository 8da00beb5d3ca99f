"""How fast each core of this machine computes while every core computes at once: one process
pinned to each core, the same single-thread matmul loop timed in turn. Issue 31: the bed's two
ranks share this machine's cores, and a job moves at its slower rank's pace; on a virtual machine
a core can run slower than its sibling for seconds while both are busy (the host's own sharing).

    python benchmarks/cores_at_once.py [--rounds 3] [--reps 12]

Prints, per round, each core's median ms for the loop alone (one core busy, in turn) and with all
busy at once, and the slowest core over the fastest.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time


def _loop(core: int, reps: int, start, out) -> None:
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    a = torch.randn(256, 256)

    def work() -> float:
        t = time.perf_counter()
        for _ in range(400):
            a @ a
        return time.perf_counter() - t

    work()
    start.wait()
    out.put((core, statistics.median(work() for _ in range(reps)) * 1e3))


def _run(cores: list[int], reps: int) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(len(cores)), ctx.Queue()
    procs = [ctx.Process(target=_loop, args=(c, reps, start, out)) for c in cores]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=300) for _ in cores)
    for p in procs:
        p.join()
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    for r in range(args.rounds):
        alone = {c: _run([c], args.reps)[c] for c in cores}
        together = _run(cores, args.reps)
        row = {"date": time.strftime("%Y-%m-%d %H:%M"), "round": r + 1, "alone_ms": {c: round(v, 1) for c, v in alone.items()},
               "together_ms": {c: round(v, 1) for c, v in together.items()},
               "slowest_over_fastest_together": round(max(together.values()) / min(together.values()), 3)}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
