"""The all-reduce probe of ``dtrain doctor``: how long an all-reduce of each size takes on the
group already joined, and nccl-tests' bus bandwidth of it. The doctor (``dtrain.cli.doctor_checks``)
starts the processes; this part only measures."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def time_all_reduce(device: torch.device, sizes: list[int], reps: int) -> dict[int, float]:
    """Collective: every rank of the default group. Median seconds of an all-reduce of each size (bytes)."""
    out = {}
    for size in sizes:
        t = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        dist.all_reduce(t)  # warm-up: connections, buffers
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            if t.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[size] = statistics.median(times)
    return out


def bus_bandwidth(size_bytes: int, seconds: float, n: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: size / time x 2(n-1)/n, in bytes/s."""
    return size_bytes / seconds * 2 * (n - 1) / n
