"""Is a pipeline's hand-off on a delayed link slowed by its sender's TCP? (issue 31: the
bed's 2-stage pipeline at 10 ms each way stays ~23% under its plan; ``p2p_rendezvous.py`` saw a
64 KiB send with its receive already posted take 21.2 ms where one latency and the bytes make
~15.6, while the links probe's send after idle, on a connection that had carried megabytes,
took 15.6.)

On 2 bed hosts, rank 0 sends ``--bytes`` to rank 1 ``--reps`` times, ``--gap`` seconds apart,
the receive posted before each send (so no rendezvous wait), on a gloo connection that has

* ``fresh``: carried only sends of this size (a pipeline's connection), then
* ``warm``: just carried one ``--warm-bytes`` send (the links probe's history),

timing each from the send to its arrival (both hosts read this machine's monotonic clock) and
reading the sender's TCP congestion window (``ss -tin``, segments) before each. One JSON line
(``--out``) with each case's times and windows, and a table.

    python benchmarks/p2p_window.py --rate 100 --delay-ms 10 [--reps 12] [--out rows.jsonl]

(root, ``ip netns``; the delay by netem or the bed's delay line.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bed_pair import link_args, run_pair  # noqa: E402


def windows(port: int) -> list[tuple[int, str]]:
    """(congestion window in segments, ``ss``'s line) of each of this host's established TCP
    connections other than the rendezvous store's (``port``): gloo's pair to the other rank."""
    out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True, text=True).stdout
    found, skip = [], False
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            skip = f":{port} " in line + " "
            continue
        m = re.search(r"\bcwnd:(\d+)", line)
        if m and not skip:
            found.append((int(m.group(1)), line.strip()))
    return found


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    if args.cc:  # this host's namespace only (the setting is per network namespace)
        subprocess.run(["sysctl", "-qw", f"net.ipv4.tcp_congestion_control={args.cc}"], check=True)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank, world_size=2)
    t, big = torch.zeros(max(1, args.bytes // 4)), torch.zeros(max(1, args.warm_bytes // 4))
    rows: dict[str, list] = {"fresh": [], "warm": []}
    for case in ("fresh", "warm"):
        for _ in range(args.reps):
            if case == "warm":
                dist.send(big, 1) if args.rank == 0 else dist.recv(big, 0)
            dist.barrier()
            if args.rank == 0:
                cwnd = windows(args.port)
                time.sleep(args.gap)
                sent = time.monotonic()
                dist.send(t, 1)
                rows[case].append([sent, max(cwnd)[0] if cwnd else None, max(cwnd)[1] if cwnd else None])
            else:
                dist.recv(t, 0)
                rows[case].append([time.monotonic(), None])
    out = [None, None]
    dist.all_gather_object(out, rows)
    if args.rank == 0:
        snd, rcv = out
        res = {}
        for case in rows:
            ms = [round((r[0] - s[0]) * 1e3, 2) for s, r in zip(snd[case], rcv[case])]
            res[case] = {"ms": ms, "median_ms": round(statistics.median(ms), 2), "cwnd": [s[1] for s in snd[case]],
                         "ss_last": snd[case][-1][2]}
        print(json.dumps(res), flush=True)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    link_args(p, 29833)
    p.add_argument("--warm-bytes", type=int, default=4 << 20, help="the send before each of the warm case's (the probe's largest)")
    p.add_argument("--gap", type=float, default=0.05, help="seconds of idle link before each timed send")
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--cc", default="", help="TCP congestion control on the bed's hosts (e.g. cubic, bbr; default: the system's)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    cc = args.cc or open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
    got = run_pair(__file__, args, ["--warm-bytes", str(args.warm_bytes), "--gap", str(args.gap), "--reps", str(args.reps), "--cc", args.cc],
                   "p2p_window")
    line = {**got, "bytes": args.bytes, "warm_bytes": args.warm_bytes, "gap_s": args.gap, "cc": cc}
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(line) + "\n")
    one = args.delay_ms + args.bytes * 8 / (args.rate * 1e6) * 1e3
    print(f"{args.rate:g} Mbit/s, {args.delay_ms:g} ms each way, TCP {line['cc']}, {args.bytes} B sends {args.gap * 1e3:g} ms apart "
          f"(one latency + the bytes at the rate: {one:.1f} ms)")
    print("| connection | median ms | each send, ms | cwnd before each (segments) |\n|---|---|---|---|")
    for case in ("fresh", "warm"):
        r = line[case]
        print(f"| {case} | {r['median_ms']} | {' '.join(map(str, r['ms']))} | {' '.join(map(str, r['cwnd']))} |")
    for case in ("fresh", "warm"):
        print(f"{case}, ss before the last send: {line[case]['ss_last']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
