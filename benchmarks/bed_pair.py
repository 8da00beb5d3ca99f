"""What the bed benchmarks share (zero1_broadcasts.py, p2p_duplex.py, allreduce_small.py): run a
worker command on the bed's hosts (2 unless told) with a shaped link and read rank 0's result line."""

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


def on_bed(command: Callable[[int, str], list[str]], rate: float, timeout: float, what: str, *, hosts: int = 2,
           delay_ms: float | None = None) -> dict:
    """``command(rank, master address)`` on each of ``hosts`` bed hosts at ``rate`` Mbit/s (and
    ``delay_ms`` on what each sends); rank 0's result."""
    from dtrain.testing.netbed import NetBed

    with NetBed(hosts=hosts, rate_mbit=rate, delay_ms=delay_ms or None) as bed:
        res = bed.run_nodes(command, timeout=timeout, env=ENV)
    return result(res[0].output, f"{what} on link {rate:g} Mbit/s")
