"""What the two-host bed benchmarks share (zero1_broadcasts.py, p2p_duplex.py, allreduce_small.py):
run a worker command on 2 bed hosts with a shaped link and read rank 0's result line."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def result(output: str, what: str) -> dict:
    """The last JSON line of ``output``; exits with one line naming ``what`` where there is none."""
    line = [ln for ln in output.splitlines() if ln.startswith("{")]
    if not line:
        raise SystemExit(f"{what}: no result: {output[-500:]}")
    return json.loads(line[-1])


def on_bed(command: Callable[[int, str], list[str]], rate: float, timeout: float, what: str) -> dict:
    """``command(rank, master address)`` on each of 2 bed hosts at ``rate`` Mbit/s; rank 0's result."""
    from dtrain.testing.netbed import NetBed

    with NetBed(hosts=2, rate_mbit=rate) as bed:
        res = bed.run_nodes(command, timeout=timeout, env=ENV)
    return result(res[0].output, f"{what} on link {rate:g} Mbit/s")
