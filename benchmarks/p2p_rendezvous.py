"""Does a gloo send wait for its receive? (issue 31: the bed's 2-stage pipeline at 10 ms each way
was planned 33% under, bed run 28.)

On 2 bed hosts with a delayed link, ``--reps`` times each: rank 0 sends ``--bytes`` to rank 1,

* ``late``: the receive posted ``--pause`` seconds after the send: arrival - the receive's post;
* ``early``: the receive posted ``--pause`` seconds before the send: arrival - the send's post;

and how long rank 0's ``send`` call took in each. The hosts share this machine's monotonic clock,
so times on the two ranks compare directly. Where a send moves its data at once (eagerly), ``late``
is ~0 (the data waits at the receiver) and ``early`` one latency + the bytes; where it waits for
the receive's notice (gloo's pairs), ``late`` is two latencies + the bytes.

    python benchmarks/p2p_rendezvous.py --rate 100 --delay-ms 10 [--bytes 65536] [--out rows.jsonl]

(root, ``ip netns``; the delay by netem or the bed's delay line.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bed_pair import link_args, run_pair  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank, world_size=2)
    t = torch.zeros(max(1, args.bytes // 4))
    rows: dict[str, list] = {"late": [], "early": []}
    for _ in range(2):  # warm-up: connections, buffers
        dist.send(t, 1) if args.rank == 0 else dist.recv(t, 0)
    for rep in range(2 * args.reps):
        case = "late" if rep % 2 == 0 else "early"
        dist.barrier()
        if args.rank == 0:
            if case == "early":
                time.sleep(args.pause)
            sent = time.monotonic()
            dist.send(t, 1)
            rows[case].append([sent, time.monotonic()])
        else:
            if case == "late":
                time.sleep(args.pause)
            posted = time.monotonic()
            dist.recv(t, 0)
            rows[case].append([posted, time.monotonic()])
    out = [None, None]
    dist.all_gather_object(out, rows)
    if args.rank == 0:
        snd, rcv = out
        late = [(r[1] - r[0]) * 1e3 for r in rcv["late"]]
        early = [(r[1] - s[0]) * 1e3 for s, r in zip(snd["early"], rcv["early"])]
        print(json.dumps({"bytes": args.bytes, "pause_s": args.pause,
                          "late_ms": round(statistics.median(late), 2), "early_ms": round(statistics.median(early), 2),
                          "send_call_late_ms": round(statistics.median((s[1] - s[0]) * 1e3 for s in snd["late"]), 2),
                          "send_call_early_ms": round(statistics.median((s[1] - s[0]) * 1e3 for s in snd["early"]), 2)}), flush=True)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    link_args(p, 29831)
    p.add_argument("--pause", type=float, default=0.1, help="seconds between the send and the receive")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    line = run_pair(__file__, args, ["--pause", str(args.pause), "--reps", str(args.reps)], "p2p_rendezvous", timeout=300)
    print(json.dumps(line))
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
