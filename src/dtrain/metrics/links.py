"""Which host's link is slow: a short, timed point-to-point exchange between the ranks (a ring
all-reduce waits for its slowest link on every rank, so step figures cannot name the host).
On a star, a host with a slow link has every transfer through it slow; with two hosts nothing
tells a's uplink from b's downlink, so no host is named."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

REPEATS = 2
MIN_PAYLOAD = 64 * 1024
MAX_PAYLOAD = 4 * 2**20


def payload_bytes(comm_bytes_per_step: float | None) -> int:
    """A quarter of one step's gradient bytes (1 MiB when unknown), within 64 KiB .. 4 MiB: bandwidth,
    not latency, sets the time, and a probe costs about a step's communication."""
    want = 2**20 if not comm_bytes_per_step else int(comm_bytes_per_step / 4)
    return max(MIN_PAYLOAD, min(MAX_PAYLOAD, want)) // 4 * 4


def probe(rank: int, size: int, device: torch.device, nbytes: int, repeats: int = REPEATS) -> list[list[float]]:
    """Collective. ``ms[src][dst]``: the fastest one-way time (ms) of ``nbytes`` from ``src`` to
    ``dst`` (NaN on the diagonal), timed at the receiver; round k sends to rank +k (batched:
    separate NCCL sends and receives in a ring could deadlock)."""
    send = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    mine = [float("inf")] * size  # mine[src]: fastest arrival here from src
    mine[rank] = float("nan")
    for _ in range(repeats):
        for k in range(1, size):
            dst, src = (rank + k) % size, (rank - k) % size
            dist.barrier()
            t0 = time.perf_counter()
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, dst), dist.P2POp(dist.irecv, recv, src)])
            works[1].wait()
            if device.type == "cuda":  # wait() orders the stream; the host clock needs the data there
                torch.cuda.current_stream(device).synchronize()
            mine[src] = min(mine[src], (time.perf_counter() - t0) * 1e3)
            works[0].wait()
    rows = torch.zeros(size, size, dtype=torch.float64, device=device)
    rows[rank] = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(rows)  # row r: what rank r received, by sender
    received = rows.cpu().tolist()
    return [[received[dst][src] for dst in range(size)] for src in range(size)]


def slow_hosts(ms: list[list[float]], host_of: list[str], threshold: float, min_excess_ms: float) -> list[dict[str, Any]]:
    """The hosts whose link is slow by the probe's matrix: ``host``, ``direction``, its fastest
    time ``ms`` and the other hosts' median ``others_ms``. Empty with fewer than three hosts."""
    hosts = list(dict.fromkeys(host_of))
    if len(hosts) < 3:
        return []
    ranks = {h: [r for r, x in enumerate(host_of) if x == h] for h in hosts}

    def fastest(h: str, upload: bool) -> float:
        pairs = [(a, b) for a in ranks[h] for b in range(len(host_of)) if host_of[b] != h]
        return min(ms[a][b] if upload else ms[b][a] for a, b in pairs)

    found = []
    for direction in ("upload", "download"):
        best = {h: fastest(h, direction == "upload") for h in hosts}
        for h in hosts:
            others = statistics.median(best[g] for g in hosts if g != h)
            if best[h] >= threshold * others and best[h] - others >= min_excess_ms:
                found.append({"host": h, "direction": direction, "ms": round(best[h], 3), "others_ms": round(others, 3)})
    return found
