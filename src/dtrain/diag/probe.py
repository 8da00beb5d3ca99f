"""The collectives probe of ``dtrain doctor`` (and ``dtrain plan --measure-links``): how long an
all-reduce of each size takes on the group already joined, nccl-tests' bus bandwidth of it, and,
for a plan's link figures, every collective a layout issues at a few sizes. This part only measures."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
"""What ``time_collectives`` measures. Sizes are the bytes of the whole tensor: the all-reduced
one, the gathered result, the input that is reduce-scattered, the broadcast one, the one sent."""
LINK_SIZES = (64, 1 << 20, 4 << 20)
"""Bytes per collective in a link measurement: one latency-bound, two whose difference gives the
bandwidth (megabytes, as gradient buckets are: a slope from small sizes would be too fast)."""


def time_all_reduce(device: torch.device, sizes: list[int], reps: int) -> dict[int, float]:
    """Collective: every rank of the default group. Median seconds of an all-reduce of each size (bytes)."""
    out = {}
    for size in sizes:
        t = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        out[size] = _call_time(lambda t=t: dist.all_reduce(t), device, reps)
    return out


def _call_time(op: Callable[[], object], device: torch.device, reps: int, expected: bool = False) -> float:
    """Seconds of one ``op`` after a barrier, ``reps`` times: their median, or with ``expected``
    their ``expected_time``."""
    op()  # warm-up: connections, buffers
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        op()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return expected_time(times) if expected else statistics.median(times)


def expected_time(times: list[float]) -> float:
    """The mean of the middle 90%: a small collective takes one of two modes, and a step pays each
    call's draw, so its average (not a median, which lands on either mode)."""
    times = sorted(times)
    cut = len(times) // 20
    return statistics.mean(times[cut:len(times) - cut])


def _ops(kind: str, nbytes: int, n: int, rank: int, device: torch.device) -> Callable[[], object]:
    """One ``kind`` collective of ``nbytes`` (rounded to whole float32 elements, a multiple of n)."""
    numel = max(n, nbytes // 4 // n * n)
    whole = torch.ones(numel, dtype=torch.float32, device=device)
    part = torch.ones(numel // n, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(whole)
    # FSDP2's own calls (torch >= 2.14 names them *_single; the *_tensor names warn there)
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    if kind == "all_gather":
        return lambda: gather(whole, part)
    if kind == "reduce_scatter":
        return lambda: scatter(part, whole)
    if kind == "broadcast":
        return lambda: dist.broadcast(whole, src=0)

    def ping_pong() -> None:  # rank 0 -> 1 -> 0; the others wait at the next barrier
        if rank == 0:
            dist.send(whole, 1)
            dist.recv(whole, 1)
        elif rank == 1:
            dist.recv(whole, 0)
            dist.send(whole, 0)
    return ping_pong


SMALL_REPS = (64 << 10, 45)
"""Sizes up to this many bytes are timed at least this many times and their ``expected_time`` kept:
their calls take one of two modes, so a median of few calls jumps between probes of one link."""


def _sized_time(op: Callable[[], object], device: torch.device, size: int, reps: int) -> float:
    """``_call_time`` of an op of ``size`` bytes, a small one as ``SMALL_REPS`` says."""
    small, at_least = SMALL_REPS
    if size <= small:
        return _call_time(op, device, max(reps, at_least), expected=True)
    return _call_time(op, device, reps)


SPREAD_KINDS = ("all_gather",)
"""Kinds whose large sizes are timed in three groups of calls and the slowest group's median kept:
a megabyte all-gather's modes come in runs of calls, and FSDP's all-gathers pay the slow one."""


def time_collectives(device: torch.device, sizes: tuple[int, ...] = LINK_SIZES, reps: int = 3) -> dict[str, dict[int, float]]:
    """Collective: every rank of the default group (at least 2). Seconds of each of ``KINDS`` at
    each size, the slowest rank's (a sender may return before its receivers); ``send_recv`` is
    half a round trip between ranks 0 and 1."""
    n, rank = dist.get_world_size(), dist.get_rank()
    plan = [(kind, size) for kind in KINDS for size in sizes]
    spread = [(kind, size) for kind, size in plan if kind in SPREAD_KINDS and size > SMALL_REPS[0]]
    order = spread + plan + spread  # the spread kinds' large sizes: three groups of calls, the other kinds between them
    mine = torch.tensor([_sized_time(_ops(kind, size, n, rank, device), device, size, reps) for kind, size in order],
                        dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    out: dict[str, dict[int, float]] = {kind: {} for kind in KINDS}
    for (kind, size), seconds in zip(order, mine.tolist()):  # a spread size: the slowest group's median
        out[kind][size] = max(out[kind].get(size, 0.0), seconds / 2 if kind == "send_recv" else seconds)
    return out


def bus_bandwidth(size_bytes: int, seconds: float, n: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: size / time x 2(n-1)/n, in bytes/s."""
    return size_bytes / seconds * 2 * (n - 1) / n
