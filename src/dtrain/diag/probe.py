"""The collectives probe of ``dtrain doctor`` (and ``dtrain plan --measure-links``): how long an
all-reduce of each size takes on the group already joined, and nccl-tests' bus bandwidth of it;
and, for a plan's link figures, the other collectives a layout issues (all-gather,
reduce-scatter, broadcast, a send and its receive), each at a few sizes. The doctor
(``dtrain.cli.doctor_probe``) starts the processes; this part only measures."""

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
bandwidth. Megabytes, as gradient buckets and FSDP units are: a shaped link's queue and TCP's
windows slow long transfers more than short ones, so a slope from small sizes would be too fast."""


def time_all_reduce(device: torch.device, sizes: list[int], reps: int) -> dict[int, float]:
    """Collective: every rank of the default group. Median seconds of an all-reduce of each size (bytes)."""
    out = {}
    for size in sizes:
        t = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        out[size] = _call_time(lambda t=t: dist.all_reduce(t), device, reps)
    return out


def _call_time(op: Callable[[], object], device: torch.device, reps: int, expected: bool = False, pause: float = 0.0) -> float:
    """Seconds of one ``op`` after a barrier (and ``pause`` seconds idle), ``reps`` times: their
    median, or with ``expected`` their ``expected_time``."""
    op()  # warm-up: connections, buffers
    times = _call_times(op, device, reps, pause)
    return expected_time(times) if expected else statistics.median(times)


def _call_times(op: Callable[[], object], device: torch.device, reps: int, pause: float = 0.0) -> list[float]:
    """Seconds of each of ``reps`` calls of ``op``, each after a barrier (and ``pause`` seconds idle)."""
    times = []
    for _ in range(reps):
        dist.barrier()
        if pause:
            time.sleep(pause)
        t0 = time.perf_counter()
        op()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def expected_time(times: list[float]) -> float:
    """What a call costs on average: the mean of the middle 90% (a stray stall of the machine left
    out). A small gloo collective takes one of two modes (fast, or several times that): a median
    lands on either, while a step pays each call's draw, so its average pays the mean."""
    times = sorted(times)
    cut = len(times) // 20
    return statistics.mean(times[cut:len(times) - cut])


def _ops(kind: str, nbytes: int, n: int, rank: int, device: torch.device, group: dist.ProcessGroup | None = None) -> Callable[[], object]:
    """One ``kind`` collective of ``nbytes`` (rounded to whole float32 elements, a multiple of n);
    ``send_recv``'s round trip on ``group`` (the default group where None)."""
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
            dist.send(whole, 1, group=group)
            dist.recv(whole, 1, group=group)
        elif rank == 1:
            dist.recv(whole, 0, group=group)
            dist.send(whole, 0, group=group)
    return ping_pong


SMALL_REPS = (64 << 10, 45)
"""Sizes up to this many bytes are timed at least this many times, and their ``expected_time``
kept, not the median: a latency-bound collective costs next to nothing to repeat, and its calls
take one of two modes, so a median of few calls jumps between probes of one link."""


def _sized_time(op: Callable[[], object], device: torch.device, size: int, reps: int) -> float:
    """``_call_time`` of an op of ``size`` bytes: a small one (``SMALL_REPS``) at least that many
    times and its expected time, a larger one ``reps`` times and its median."""
    small, at_least = SMALL_REPS
    if size <= small:
        return _call_time(op, device, max(reps, at_least), expected=True)
    return _call_time(op, device, reps)


SPREAD_KINDS = ("all_gather",)
"""Kinds whose sizes above ``SMALL_REPS``' are timed in three groups of calls (before, amid and
after the others) and the slowest group's median kept: on a shaped link a megabyte all-gather
takes one of two modes that come in runs of calls (the link's rate, or ~1.5x), and FSDP's
all-gathers in training pay the slow one (benchmarks/allgather_modes.py)."""


def time_collectives(device: torch.device, sizes: tuple[int, ...] = LINK_SIZES, reps: int = 3) -> dict[str, dict[int, float]]:
    """Collective: every rank of the default group (at least 2). Median seconds of each of
    ``KINDS`` at each size after a barrier (``reps`` times; small sizes at least ``SMALL_REPS``
    times, their ``expected_time``; ``SPREAD_KINDS``' large sizes in three groups, the slowest kept),
    the slowest rank's (a sender's call may return once its socket buffers hold the data; its
    receivers' do not); ``send_recv`` is half a round trip between ranks 0 and 1 (one transfer one
    way). The same values on every rank."""
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
    out[CROSSED] = time_crossed(device, out["send_recv"], reps)
    out[IDLE] = time_after_idle(device, out["send_recv"], reps)
    out[STREAM] = time_stream(device, out["send_recv"], reps)
    return out


IDLE = "send_recv_after_idle"
"""A send between ranks 0 and 1 (half a round trip, as ``send_recv``) after the link sat idle for
as long as one send of that size takes: what a step's first transfer after its compute costs. A
rate-shaping link (a token bucket: the test bed's ``tbf``, a cloud NIC's limiter) lets a burst
through at once after idle time, so a small transfer then costs its latency alone
(benchmarks/allreduce_sizes.py)."""
IDLE_SIZE = 64 << 10
"""The size sent after idle: above a shaper's burst, within a socket's buffer."""
IDLE_REPS = 9


def time_after_idle(device: torch.device, one_way: dict[int, float], reps: int) -> dict[int, float]:
    """Collective: every rank of the default group. ``IDLE`` at ``IDLE_SIZE``: the median of
    ``IDLE_REPS`` (at least ``reps``) round trips, each after a barrier and a pause of one send's
    time (``one_way``: ``send_recv``'s seconds by size), halved; the slowest rank's."""
    op = _ops("send_recv", IDLE_SIZE, dist.get_world_size(), dist.get_rank(), device)
    got = _call_time(op, device, max(reps, IDLE_REPS), pause=min(0.2, one_way_at(one_way, IDLE_SIZE)))
    mine = torch.tensor([got / 2], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return {IDLE_SIZE: mine.item()}


STREAM = "send_recv_stream"
"""A send of ``IDLE_SIZE`` between ranks 0 and 1 (half a round trip) on a connection of its own
that has carried nothing else, each after a pause as ``IDLE``'s: what a pipeline's hand-off costs
on its connection once that has settled. A sender's TCP may pace such a connection below the
link's rate (BBR estimates the bandwidth from what small bursts delivered:
benchmarks/p2p_window.py); the probe's other sends run on the default group's connection, which
its megabyte sizes have warmed."""
STREAM_REPS = 12
"""Round trips timed on the new connection; the median of the second half is kept (after TCP's start-up)."""


def time_stream(device: torch.device, one_way: dict[int, float], reps: int) -> dict[int, float]:
    """Collective: every rank of the default group (each joins the new group of ranks 0 and 1).
    ``STREAM`` at ``IDLE_SIZE``: ``STREAM_REPS`` (at least ``reps``) round trips on the new
    group, each after a barrier and a pause of one send's time (``one_way``); the median of the
    second half, halved; the slowest rank's."""
    pair = dist.new_group([0, 1])
    op = _ops("send_recv", IDLE_SIZE, 2, dist.get_rank(), device, group=pair)  # no warm-up: the connection's start is timed
    times = _call_times(op, device, max(reps, STREAM_REPS), pause=min(0.2, one_way_at(one_way, IDLE_SIZE)))
    dist.destroy_process_group(pair)
    mine = torch.tensor([statistics.median(times[len(times) // 2:]) / 2], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return {IDLE_SIZE: mine.item()}


CROSSED = "send_recv_crossed"
"""Two sends between ranks 0 and 1 in opposite directions, the second fired while the first is
on its way (``CROSSED_LAG`` of one send's time later): seconds from the first's start until both
have arrived. A link whose two directions were independent takes (1 + lag) x one send; on a
shaped link a transfer's acknowledgements queue behind the other direction's data
(benchmarks/p2p_duplex.py)."""
CROSSED_SIZES = (64 << 10, 1 << 20)
"""Sizes of a pipeline's hand-offs (an activation or its gradient): one that a socket's buffer
holds, one it does not."""
CROSSED_LAG = 0.25


def time_crossed(device: torch.device, one_way: dict[int, float], reps: int) -> dict[int, float]:
    """Collective: every rank of the default group. ``CROSSED`` at each of ``CROSSED_SIZES``, the
    slowest rank's ``_sized_time``; ``one_way``: ``send_recv``'s seconds by size, which set the lag."""
    rank = dist.get_rank()
    out = {}
    for size in CROSSED_SIZES:
        lag = CROSSED_LAG * one_way_at(one_way, size)
        got = _sized_time(_crossed(size, rank, lag, device), device, size, reps)
        mine = torch.tensor([got], dtype=torch.float64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        out[size] = mine.item()
    return out


def one_way_at(one_way: dict[int, float], nbytes: float) -> float:
    """Seconds of one send of ``nbytes`` from ``send_recv``'s measured sizes: linear between the
    two around it, the nearest two's line beyond them (never below the smallest's time)."""
    pts = sorted(one_way.items())
    if len(pts) == 1:
        return pts[0][1]
    i = next((k for k in range(1, len(pts)) if nbytes <= pts[k][0]), len(pts) - 1)
    (b0, t0), (b1, t1) = pts[i - 1], pts[i]
    return max(pts[0][1], t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0))


def _crossed(nbytes: int, rank: int, lag: float, device: torch.device) -> Callable[[], object]:
    """Rank 0 sends to rank 1 at once, rank 1 to rank 0 ``lag`` seconds later (a busy wait: a sleep
    overshoots a short lag); each waits for its send and its receive. The others do nothing."""
    out = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    into = torch.empty_like(out)

    def op() -> None:
        if rank > 1:
            return
        if rank == 1:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < lag:
                pass
        works = [dist.isend(out, 1 - rank), dist.irecv(into, 1 - rank)]
        for w in works:
            w.wait()
    return op


def bus_bandwidth(size_bytes: int, seconds: float, n: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: size / time x 2(n-1)/n, in bytes/s."""
    return size_bytes / seconds * 2 * (n - 1) / n
