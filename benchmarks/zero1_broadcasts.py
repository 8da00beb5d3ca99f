"""How long ZeRO-1's parameter broadcasts take on a link, against the plan's two ways of pricing them
(issue 31, bed run 11: lm-1g zero1 predicted +31.5%).

torch's ``ZeroRedundancyOptimizer._sync_params`` issues every parameter's broadcast from the rank that
stepped it with ``async_op=True``, all ranks' in turn, then waits for them all. This script times that
pattern (``queued``) beside the same broadcasts each waited for in turn (``waited``) and one 64-byte
broadcast after a barrier (the doctor's latency figure), on 2 bed hosts with a shaped link and on the
loopback of one host, over gloo.

    python benchmarks/zero1_broadcasts.py --rates 1000,100,20 --tensors 38 --total-bytes 547840
    python benchmarks/zero1_broadcasts.py --rates 100 --numel 401408,512,262144,512,5120,10   # the bed's mlp
    python benchmarks/zero1_broadcasts.py --hosts 3 --rates 50 --delay-ms 5 --numel ...          # 3 hosts, delayed

(root, ``ip netns``). One JSON line per link (``--out``) and a table: medians of ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bed_pair import ENV, on_bed, result  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank, world_size=args.hosts)
    n = dist.get_world_size()
    if args.numel:  # a model's own tensors, owned and ordered as ZeRO's greedy partition does
        sizes = [int(x) for x in args.numel.split(",")]
        from plan_bed import zero_broadcasts  # torch's ZeroRedundancyOptimizer partition and order

        owner, tensors = zip(*((r, torch.ones(int(k))) for r, k in zero_broadcasts(sizes, n)))
    else:
        per = max(1, args.total_bytes // args.tensors // 4)
        tensors = [torch.ones(per) for _ in range(args.tensors)]
        owner = [i * n // args.tensors for i in range(args.tensors)]  # contiguous shares, as ZeRO partitions
    tiny = torch.ones(16)

    def queued() -> None:
        handles = [dist.broadcast(t, src=o, async_op=True) for o in range(n) for t, w in zip(tensors, owner) if w == o]
        for h in handles:
            h.wait()

    def waited() -> None:
        for o in range(n):
            for t, w in zip(tensors, owner):
                if w == o:
                    dist.broadcast(t, src=o)

    def one() -> None:
        dist.broadcast(tiny, src=0)

    out = {}
    for name, op in (("queued", queued), ("waited", waited), ("one_64B", one)):
        op()
        times = []
        for _ in range(args.reps):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        mine = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        out[name] = round(mine.item() * 1e3, 3)
    if args.rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def run_link(args: argparse.Namespace, rate: float | None, port: int) -> dict:
    me = [sys.executable, os.path.abspath(__file__), "--worker", "--tensors", str(args.tensors),
          "--total-bytes", str(args.total_bytes), "--reps", str(args.reps), "--port", str(port), "--numel", args.numel,
          "--hosts", str(args.hosts)]
    if rate is None:  # one host: the processes over loopback
        procs = [subprocess.Popen([*me, "--rank", str(r), "--master", "127.0.0.1"], stdout=subprocess.PIPE, text=True, env=ENV)
                 for r in range(args.hosts)]
        try:
            outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        finally:  # a hang ends here, with both ranks
            for p in procs:
                p.kill()
                p.wait()
        ms = result(outs[0], "zero1_broadcasts on loopback")
    else:
        ms = on_bed(lambda r, master: [*me, "--rank", str(r), "--master", master], rate, args.timeout, "zero1_broadcasts",
                    hosts=args.hosts, delay_ms=args.delay_ms)
    shape = {"numel": args.numel} if args.numel else {"tensors": args.tensors, "total_bytes": args.total_bytes}
    row = {"rate_mbit": rate, "hosts": args.hosts, "delay_ms": args.delay_ms, **shape, "reps": args.reps, "ms": ms}
    if rate is not None:
        row["bytes_ms"] = bytes_times(args, rate)
    return row


def bytes_times(args: argparse.Namespace, rate: float) -> dict:
    """The plan's two ways of pricing the broadcasts' bytes at the link's rate (no latency): gloo's
    trees played out two at a time (``plan_bed.queued_broadcasts``, the bed's model) and
    every tree's bytes one after another (``costs.broadcast``, the plan's before)."""
    from dataclasses import replace

    from plan_bed import queued_broadcasts, zero_broadcasts

    from dtrain.plan import cluster, costs

    n = args.hosts
    sizes = [int(x) for x in args.numel.split(",")] if args.numel else [max(1, args.total_bytes // args.tensors // 4)] * args.tensors
    sends = [(r, 4 * e) for r, e in zero_broadcasts(sizes, n)]
    c = replace(cluster.build({"device": "cpu", "nodes": n, "procs_per_node": 1}), inter_bw=rate * 1e6 / 8, inter_lat=0.0)
    g = costs.Group(n, 1)
    return {"played_out": round(1e3 * queued_broadcasts(sends, g, c), 1),
            "one_after_another": round(1e3 * costs.broadcast(sum(b for _, b in sends), g, c), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29811)
    p.add_argument("--rates", default="1000,20", help="Mbit/s of the bed links, comma-separated; 'lo': one host's loopback")
    p.add_argument("--tensors", type=int, default=38, help="parameter tensors (the bed's lm: 38)")
    p.add_argument("--total-bytes", type=int, default=547840, help="bytes of all of them (the bed's lm: 136,960 fp32)")
    p.add_argument("--numel", default="", help="elements of each of a model's tensors, comma-separated (instead of "
                   "--tensors/--total-bytes; the bed's mlp: 401408,512,262144,512,5120,10)")
    p.add_argument("--hosts", type=int, default=2, help="bed hosts, one rank each (default 2)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="added to what each host sends (default none)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=1, help="each link this many times, links alternating")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    rates = [None if r == "lo" else float(r) for r in args.rates.split(",")]
    rows = []
    for rnd in range(args.rounds):
        for i, rate in enumerate(rates if rnd % 2 == 0 else list(reversed(rates))):
            row = {**run_link(args, rate, args.port + 10 * rnd + i), "round": rnd, "load1": round(os.getloadavg()[0], 2)}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
            if args.out:
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
    what = f"tensors of {args.numel} elements" if args.numel else f"{args.tensors} tensors, {args.total_bytes:,} bytes"
    print(f"\n{what}, {args.hosts} ranks, gloo, {args.delay_ms:g} ms each way; medians of {args.reps} (ms)")
    print("| link | round | queued (ZeRO's) | each waited | one 64 B broadcast | bytes: played out | bytes: one after "
          "another | load |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, b = r["ms"], r.get("bytes_ms", {})
        link = "loopback" if r["rate_mbit"] is None else f"{r['rate_mbit']:g} Mbit/s"
        print(f"| {link} | {r['round']} | {m['queued']} | {m['waited']} | {m['one_64B']} | {b.get('played_out', '-')} | "
              f"{b.get('one_after_another', '-')} | {r['load1']} |")


if __name__ == "__main__":
    main()
