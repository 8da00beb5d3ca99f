"""How much shorter a transfer is when the link sat idle for a gap before it, gap by gap, on a
shaped bed link. Issue 31: the plan takes ``min(gap, burst / rate)`` off a transfer that finds
its link idle (the ``tbf`` shaper's bucket refills at the rate while idle, up to its burst:
16384 bytes at 20 Mbit/s, 6.6 ms of sending), for FSDP's gathers and scatters, a pipeline's
sends and DDP's buckets; this measures the curve that rule stands on.

    python benchmarks/transfer_after_gap.py --rate 20 [--gaps 0,1,2,4,8,16,32] [--reps 11]

(root, ``ip netns``). Each transfer follows one of the same size (the link busy up to then) and
a pause of the gap; its time is taken from its start on the sender to its end on the receiver
(both on this machine's monotonic clock). One JSON line (``--out``) and a table: the median ms
per gap, what it saved against the gap 0, and what the rule says it saves.
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

KINDS = (("send_recv", 64 << 10), ("all_reduce", 64 << 10), ("all_gather", 128 << 10), ("send_recv", 256 << 10))
"""(collective, bytes): a pipeline's hand-off, DDP's bucket or PowerSGD's all-reduce, FSDP's unit
(the full gathered result; each rank sends half), a larger hand-off."""


def _call(kind: str, rank: int, t) -> None:
    import torch.distributed as dist

    if kind == "send_recv":
        (dist.send if rank == 0 else dist.recv)(t, 1 - rank)
    elif kind == "all_reduce":
        dist.all_reduce(t)
    else:
        dist.all_gather_into_tensor(t, t[: t.numel() // 2].clone())


def worker(rank: int, master: str, port: int, gaps: list[float], reps: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2)
    out = {}
    clock = torch.zeros(3, dtype=torch.float64)
    for kind, size in KINDS:
        t = torch.ones(size // 4)
        _call(kind, rank, t)
        for gap in gaps:
            times, gaps_seen = [], []
            for _ in range(reps):
                dist.barrier()
                _call(kind, rank, t)  # the link busy with one of the same size up to its end
                clock.zero_()
                if kind != "send_recv" or rank == 1:  # the end on the receiving side (each side's for a collective)
                    clock[rank] = time.monotonic()
                dist.all_reduce(clock, op=dist.ReduceOp.MAX)  # a few bytes: both know when the link went idle
                idle_from = clock[:2].max().item()
                time.sleep(max(0.0, idle_from + gap - time.monotonic()))  # the exchange itself takes ~1 ms of it
                start = time.monotonic()
                _call(kind, rank, t)
                end = time.monotonic()
                clock.zero_()
                if rank == 0:
                    clock[0], clock[2] = start, start - idle_from
                else:
                    clock[1] = end
                dist.all_reduce(clock, op=dist.ReduceOp.MAX)
                times.append(clock[1].item() - clock[0].item())
                gaps_seen.append(clock[2].item())
            out[f"{kind} {size} {gap * 1e3:g}"] = [round(statistics.median(times) * 1e3, 3), round(statistics.median(gaps_seen) * 1e3, 2)]
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=20.0, help="Mbit/s of the bed link")
    p.add_argument("--burst", type=float, default=16384, help="the shaper's burst, bytes (the bed's: max(16 KiB, 2 ms at the rate))")
    p.add_argument("--gaps", default="0,1,2,4,8,16,32", help="ms of idle link before the timed transfer")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--port", type=int, default=29971)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        r, m, port, gaps, reps = args.worker
        worker(int(r), m, int(port), [float(g) / 1e3 for g in gaps.split(",")], int(reps))
        return
    ms = on_bed(lambda r, m: [sys.executable, os.path.abspath(__file__), "--worker", str(r), m, str(args.port), args.gaps,
                              str(args.reps)], args.rate, 900, "transfer_after_gap")
    row = {"date": time.strftime("%Y-%m-%d"), "rate_mbit": args.rate, "reps": args.reps, "ms_median": ms,
           "load1": round(os.getloadavg()[0], 2)}
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    cap = args.burst * 8 / (args.rate * 1e6) * 1e3
    print(f"{args.rate:g} Mbit/s (load {row['load1']}), median ms of {args.reps}; the rule saves min(gap, {cap:.1f} ms)")
    print("| transfer | gap ms (as it came) | ms | saved vs the first gap | the rule's over the first gap |\n|---|---|---|---|---|")
    for kind, size in KINDS:
        base, g0 = ms[f"{kind} {size} {args.gaps.split(',')[0]}"]
        for gap in args.gaps.split(","):
            got, seen = ms[f"{kind} {size} {gap}"]
            print(f"| {kind} {size // 1024} KiB | {gap} ({seen:.1f}) | {got} | {base - got:.1f} | {min(seen, cap) - min(g0, cap):.1f} |")

if __name__ == "__main__":
    main()
