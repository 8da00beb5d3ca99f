"""What the bed benchmarks share (zero1_broadcasts.py, p2p_duplex.py, allreduce_small.py, p2p_rendezvous.py, p2p_window.py): run a
worker command on the bed's hosts (2 unless told) with a shaped link and read rank 0's result line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.support: the harness that only tests and benchmarks use

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def link_args(p: argparse.ArgumentParser, port: int) -> None:
    """The flags of a two-host send benchmark (p2p_rendezvous.py, p2p_window.py): the worker's own
    (hidden) and the bed link's."""
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--rate", type=float, default=100.0, help="Mbit/s of each host's link")
    p.add_argument("--delay-ms", type=float, default=10.0, help="added to what each host sends (a round trip: twice this)")
    p.add_argument("--bytes", type=int, default=65536, help="bytes per send (the bed lm's activation per micro-batch: 65536)")


def result(output: str, what: str) -> dict:
    """The last JSON line of ``output``; exits with one line naming ``what`` where there is none."""
    line = [ln for ln in output.splitlines() if ln.startswith("{")]
    if not line:
        raise SystemExit(f"{what}: no result: {output[-500:]}")
    return json.loads(line[-1])


def on_bed(command: Callable[[int, str], list[str]], rate: float, timeout: float, what: str, *, hosts: int = 2,
           delay_ms: float | None = None) -> dict:
    """``command(rank, master address)`` on each of ``hosts`` bed hosts at ``rate`` Mbit/s (and
    ``delay_ms`` on what each sends); rank 0's result."""
    from tests.support.netbed import NetBed

    with NetBed(hosts=hosts, rate_mbit=rate, delay_ms=delay_ms or None) as bed:
        res = bed.run_nodes(command, timeout=timeout, env=ENV)
    return result(res[0].output, f"{what} on link {rate:g} Mbit/s")


def run_pair(script: str, args: argparse.Namespace, flags: list[str], what: str, timeout: float = 600) -> dict:
    """``script --worker FLAGS`` on 2 bed hosts shaped by ``link_args``' flags; rank 0's result with
    the link, the date and the commit."""
    import subprocess
    import time

    from tests.support.netbed import NetBed

    cmd = [sys.executable, os.path.abspath(script), "--worker", "--port", str(args.port), "--bytes", str(args.bytes), *flags]
    with NetBed(hosts=2, rate_mbit=args.rate, delay_ms=args.delay_ms or None) as bed:
        outs = bed.run_nodes(lambda r, master: [*cmd, "--rank", str(r), "--master", master], timeout=timeout, env=ENV)
        line = {"rate_mbit": args.rate, "delay_ms": args.delay_ms, "delay_line": bed.delay_line, **result(outs[0].output, what)}
    return {**line, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=os.path.dirname(os.path.abspath(script))).stdout.strip()}
