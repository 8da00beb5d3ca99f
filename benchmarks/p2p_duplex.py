"""Whether a bed link carries two transfers in opposite directions at once (issue 31: the bed's
pipelines ran 16-20% over the plan's schedule, whose simulation gives each direction its own link).

On 2 bed hosts with a shaped link (gloo, one process each), medians of ``--reps`` of:
``one_way`` (rank 0 sends BYTES, rank 1 receives; timed to the receiver's end), ``exchange`` (each
rank sends BYTES to the other at once: isend + irecv, both waited), ``exchange_lag`` (the same, rank 1's
send started LAG ms after rank 0's, as a pipeline's gradient meets the next activation). The
doctor's send/recv figure comes from one direction at a time.

    python benchmarks/p2p_duplex.py --rates 100,20 --bytes 65536

(root, ``ip netns``). One JSON line per link (``--out``) and a table.
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


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank, world_size=2)
    me, other = args.rank, 1 - args.rank
    out_buf, in_buf = torch.ones(args.bytes // 4), torch.empty(args.bytes // 4)

    def one_way() -> None:
        if me == 0:
            dist.send(out_buf, 1)
        else:
            dist.recv(in_buf, 0)

    def exchange(lag: float = 0.0) -> None:
        t0 = time.perf_counter()
        if me == 1 and lag:
            time.sleep(lag)
        works = [dist.isend(out_buf, other), dist.irecv(in_buf, other)]
        for w in works:
            w.wait()
        return (time.perf_counter() - t0) - (lag if me == 1 else 0.0)

    out = {}
    lags = [float(v) for v in args.lag_ms.split(",")]
    ops = [("one_way", one_way), ("exchange", exchange)] + [(f"lag_{v:g}", lambda v=v: exchange(v / 1e3)) for v in lags]
    for name, op in ops:
        op()
        times = []
        for _ in range(args.reps):
            dist.barrier()
            t0 = time.perf_counter()
            own = op()
            times.append(own if own is not None else time.perf_counter() - t0)
        both = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
        dist.all_gather(both, torch.tensor([statistics.median(times)], dtype=torch.float64))
        out[name] = [round(t.item() * 1e3, 3) for t in both]  # rank 0's, rank 1's (from its own start)
    if me == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def run_link(args: argparse.Namespace, rate: float, port: int) -> dict:
    me = [sys.executable, os.path.abspath(__file__), "--worker", "--bytes", str(args.bytes), "--reps", str(args.reps),
          "--lag-ms", str(args.lag_ms), "--port", str(port)]
    ms = on_bed(lambda r, master: [*me, "--rank", str(r), "--master", master], rate, args.timeout, "p2p_duplex")
    return {"rate_mbit": rate, "bytes": args.bytes, "reps": args.reps, "lag_ms": args.lag_ms, "ms": ms,
            "bytes_ms": round(args.bytes * 8 / (rate * 1e6) * 1e3, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29831)
    p.add_argument("--rates", default="100,20", help="Mbit/s of the bed links, comma-separated")
    p.add_argument("--bytes", type=int, default=65536, help="bytes per transfer (the bed's lm pipeline hop: 65,536)")
    p.add_argument("--lag-ms", default="2,10", help="rank 1's send this many ms after rank 0's (comma-separated)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for i, rate in enumerate(float(r) for r in args.rates.split(",")):
        row = {**run_link(args, rate, args.port + i), "load1": round(os.getloadavg()[0], 2)}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    print(f"\n{args.bytes:,} bytes per transfer, 2 ranks, gloo; medians of {args.reps} (ms)")
    names = list(rows[0]["ms"])
    print("each: rank 0's / rank 1's, from its own send's start (one way: the sender's / the receiver's)")
    print("| link | its bytes' time | " + " | ".join(names) + " | load |\n|---|---|" + "---|" * len(names) + "---|")
    for r in rows:
        cells = " | ".join(f"{a} / {b}" for a, b in (r["ms"][k] for k in names))
        print(f"| {r['rate_mbit']:g} Mbit/s | {r['bytes_ms']} | {cells} | {r['load1']} |")


if __name__ == "__main__":
    main()
