"""One timeline of every rank: the breakdown's spans (data wait, forward, backward, exposed
communication, optimizer step, checkpoint saves, the rest) of a range of steps, merged into a
single Chrome/Perfetto trace JSON on rank 0's clock.

Each rank's clock is aligned to rank 0's the way NTP does: rank 0 sends its time t1, the rank
answers with its time t2 at once, rank 0 notes t4 on receipt; the rank's offset is
t2 - (t1 + t4) / 2, from the round with the shortest round trip of several (its error is at most
half that round trip, recorded per rank in the file). Spans are host times: on a GPU they show
when work was issued, not when the device ran it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError

ROUNDS = 8


def parse_steps(spec: str) -> tuple[int, int]:
    """``"20:25"`` -> (20, 25): steps 20 to 24 (the end is not included, as in a Python slice)."""
    try:
        a, b = (int(v) for v in spec.split(":"))
    except ValueError:
        raise ConfigError(f"--trace {spec!r} is not START:END; e.g. --trace 20:25 for steps 20 to 24.") from None
    if a < 1 or b <= a:
        raise ConfigError(f"--trace {spec} needs 1 <= START < END; e.g. --trace 20:25 for steps 20 to 24.")
    return a, b


def clock_offsets(rank: int, size: int, device: torch.device) -> list[tuple[float, float]]:
    """Collective: call on every rank. On rank 0, each rank's (offset s, round trip s) to rank 0's
    ``perf_counter`` (rank time - offset = rank 0's time); an empty list elsewhere."""
    if size == 1 or not dist.is_initialized():
        return [(0.0, 0.0)] if rank == 0 else []
    out: list[tuple[float, float]] = [(0.0, 0.0)]
    box = torch.zeros(1, dtype=torch.float64, device=device)
    for peer in range(1, size):
        best = (0.0, float("inf"))
        for _ in range(ROUNDS):
            if rank == 0:
                box.fill_(time.perf_counter())
                t1 = box.item()
                dist.send(box, peer)
                dist.recv(box, peer)
                t2, t4 = box.item(), time.perf_counter()
                if t4 - t1 < best[1]:
                    best = (t2 - (t1 + t4) / 2, t4 - t1)
            elif rank == peer:
                dist.recv(box, 0)
                box.fill_(time.perf_counter())
                dist.send(box, 0)
        out.append(best)
    return out if rank == 0 else []


class Tracer:
    """Collects this rank's spans of steps ``start`` to ``end - 1`` (the loop's step numbers)."""

    def __init__(self, steps: tuple[int, int], path: str, *, rank: int, size: int, device: torch.device, first_step: int = 0,
                 first_index: int = 0) -> None:
        self.start, self.end = steps
        self.first_index = first_index
        self.path = path
        self.rank = rank
        self.first_step = first_step
        self.spans: list[tuple[int, str, float, float]] = []
        self.done = False
        self.offsets = clock_offsets(rank, size, device)  # collective, once

    def on_step(self, index: int, spans: list[tuple[str, float, float]]) -> None:
        """A breakdown listener: ``index`` counts this run's closed steps from 0."""
        step = self.first_step + index - self.first_index + 1
        if self.start <= step < self.end:
            self.spans.extend((step, name, t0, t1) for name, t0, t1 in spans)

    def due(self, step: int) -> bool:
        return not self.done and step >= self.end

    def write(self, gather_object: Any, hosts: list[str]) -> str | None:
        """Collective: call on every rank. Rank 0 writes the merged file; returns its path there."""
        self.done = True
        every = gather_object(self.spans, dst=0)
        if self.rank != 0:
            return None
        doc = merge(every, self.offsets, hosts, (self.start, self.end))
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        with open(self.path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh)
        return self.path


def merge(per_rank: list[list[tuple[int, str, float, float]]], offsets: list[tuple[float, float]], hosts: list[str],
          steps: tuple[int, int]) -> dict[str, Any]:
    """The Chrome trace document: one process per rank, times in microseconds from the first span."""
    aligned = [[(s, n, t0 - offsets[r][0], t1 - offsets[r][0]) for s, n, t0, t1 in spans] for r, spans in enumerate(per_rank)]
    zero = min((t0 for spans in aligned for _, _, t0, _ in spans), default=0.0)
    events: list[dict[str, Any]] = []
    for r, spans in enumerate(aligned):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r} ({hosts[r]})"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}})
        for step, name, t0, t1 in spans:
            events.append({"name": name, "cat": "step", "ph": "X", "pid": r, "tid": 0,
                           "ts": round((t0 - zero) * 1e6, 3), "dur": round((t1 - t0) * 1e6, 3), "args": {"step": step}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "dtrain --trace",
            "steps": f"{steps[0]}:{steps[1]}",
            "clock": "each rank's time.perf_counter, shifted onto rank 0's clock",
            "clock_offsets_us": {str(r): round(o * 1e6, 3) for r, (o, _) in enumerate(offsets)},
            "clock_error_bound_us": {str(r): round(rtt / 2 * 1e6, 3) for r, (_, rtt) in enumerate(offsets)},
            "clock_method": f"NTP-style ping-pong with rank 0 over the process group, shortest of {ROUNDS} round trips",
        },
    }
