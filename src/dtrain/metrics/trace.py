"""One Chrome/Perfetto timeline of every rank (docs/observability.md): the breakdown's spans and
the profiler's collectives of a range of steps, each rank's clock aligned to rank 0's as NTP does."""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from ..errors import ConfigError

ROUNDS = 8
_COLLECTIVE = re.compile(r"^(gloo|nccl|mpi|ucc|xccl):(\w+)")
"""How c10d names a collective's work in the profiler (its ``profilingTitle``)."""
_MARK = "dtrain.trace.clock"


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
        self.comm: list[tuple[int, str, float, float]] = []
        """This rank's collectives in the traced steps: (step, name, start s, end s)."""
        self.done = False
        self.offsets = clock_offsets(rank, size, device)  # collective, once
        self._cuda = device.type == "cuda"
        self._prof: profile | None = None
        self._clock = 0.0  # perf_counter s minus profiler us / 1e6
        if self.start == first_step + 1:  # the first traced step is the next one
            self._profile()

    def on_step(self, index: int, spans: list[tuple[str, float, float]]) -> None:
        """A breakdown listener: ``index`` counts this run's closed steps from 0."""
        step = self.first_step + index - self.first_index + 1
        if self.start <= step < self.end:
            self.spans.extend((step, name, t0, t1) for name, t0, t1 in spans)
        if step == self.start - 1:
            self._profile()  # between two steps: neither step's spans hold its start
        elif step == self.end - 1:
            self._collectives()

    def _profile(self) -> None:
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # kineto's start/stop lines on stderr, unless the user asked for them
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        t = time.perf_counter()
        with record_function(_MARK):
            pass
        self._clock = t

    def _collectives(self) -> None:
        """Stop the profiler; keep the collectives that started in a traced step."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        events = prof.events()
        mark = next((e for e in events if e.name == _MARK), None)
        if mark is None:
            return
        shift = self._clock - mark.time_range.start / 1e6
        steps: dict[int, tuple[float, float]] = {}
        for step, _, t0, t1 in self.spans:
            a, b = steps.get(step, (t0, t1))
            steps[step] = (min(a, t0), max(b, t1))
        for e in events:
            match = _COLLECTIVE.match(e.name)
            device = e.device_type == DeviceType.CUDA
            if not match and not (device and "nccl" in e.name.lower()):
                continue
            t0, t1 = e.time_range.start / 1e6 + shift, e.time_range.end / 1e6 + shift
            step = next((s for s, (a, b) in steps.items() if a <= t0 < b), None)
            if step is not None:
                self.comm.append((step, f"{match.group(2)}" if match else f"gpu: {e.name}", t0, t1))

    def due(self, step: int) -> bool:
        return not self.done and step >= self.end

    def write(self, gather_object: Any, hosts: list[str]) -> str | None:
        """Collective: call on every rank. Rank 0 writes the merged file; returns its path there."""
        self.done = True
        self._collectives()  # the run ended inside the traced steps
        every = gather_object((self.spans, bucketed(self.spans, self.comm)), dst=0)
        if self.rank != 0:
            return None
        doc = merge([s for s, _ in every], self.offsets, hosts, (self.start, self.end), comm=[c for _, c in every])
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        with open(self.path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh)
        return self.path


def bucketed(spans: list[tuple[int, str, float, float]], comm: list[tuple[int, str, float, float]]) -> list[tuple[int, str, float, float]]:
    """Collectives named for the trace: those launched inside a step's backward (DDP's, FSDP's
    gradient buckets, in launch order) as ``all_reduce bucket 0``, ...; the others by operation."""
    backward = {s: (t0, t1) for s, n, t0, t1 in spans if n == "backward"}
    ends = {s: t1 for s, n, _, t1 in spans if n in ("backward", "comm")}
    out, seen = [], dict.fromkeys(backward, 0)
    for step, name, t0, t1 in sorted(comm, key=lambda c: c[2]):
        if step in backward and backward[step][0] <= t0 <= ends[step] and not name.startswith("gpu: "):
            name, seen[step] = f"{name} bucket {seen[step]}", seen[step] + 1
        out.append((step, name, t0, t1))
    return out


def merge(per_rank: list[list[tuple[int, str, float, float]]], offsets: list[tuple[float, float]], hosts: list[str],
          steps: tuple[int, int], comm: list[list[tuple[int, str, float, float]]] | None = None) -> dict[str, Any]:
    """The Chrome trace document: one process per rank, its phases on one track and its
    collectives on another; times in microseconds from the first span."""
    comm = comm or [[] for _ in per_rank]
    shifted = [[[(s, n, t0 - offsets[r][0], t1 - offsets[r][0]) for s, n, t0, t1 in spans] for r, spans in enumerate(kind)]
               for kind in (per_rank, comm)]
    zero = min((t0 for kind in shifted for spans in kind for _, _, t0, _ in spans), default=0.0)
    events: list[dict[str, Any]] = []
    for r in range(len(per_rank)):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r} ({hosts[r]})"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}})
        for tid, track in enumerate(("phases", "collectives")):
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": track}})
            for step, name, t0, t1 in shifted[tid][r]:
                # The end is rounded, not the length, so that a span that ends where the next starts stays so.
                ts, end = round((t0 - zero) * 1e6, 3), round((t1 - zero) * 1e6, 3)
                events.append({"name": name, "cat": track, "ph": "X", "pid": r, "tid": tid, "ts": ts, "dur": round(end - ts, 3),
                               "args": {"step": step}})
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
            "collectives": "torch.profiler's c10d work events (launch to completion), on track 'collectives'",
        },
    }
