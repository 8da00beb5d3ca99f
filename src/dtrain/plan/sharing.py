"""What sharing the profile's cores costs a job whose processes run on them (``--shared-cores``,
as on the network test bed): processes stepping at once (``corun``), and ranks that drift apart
between meetings (``drift_stretches``, local SGD's). Measured in fresh processes, as
``machinery``'s profile is."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def corun(task_spec: tuple[str, str | None, dict[str, str]], *, processes: int, batch: int, precision: str,
          optimizer: str, threads: int = 1, budget_s: float = 3.0) -> tuple[int, float, float]:
    """(processes, plain step seconds of one process alone, of ``processes`` at once): the
    plain step in ``processes`` fresh processes, first on rank 0 while the others wait, then on
    all together, at one moment, so the ratio is what sharing the cores costs (time slices,
    caches, context switches) with the load of that moment in both."""
    from ..launch.local import run_distributed

    spec = {"task": task_spec, "batch": batch, "precision": precision, "optimizer": optimizer, "kinds": [],
            "microbatches": 1, "schedule": "1f1b", "threads": threads, "budget_s": budget_s}
    raw = run_distributed(corun_body, spec, world_size=processes, timeout=120 + 6 * budget_s,
                          env={"OMP_NUM_THREADS": str(threads)})
    return processes, raw[0]["alone"], statistics.mean(r["together"] for r in raw)


def corun_body(spec: dict[str, Any]) -> dict[str, float | None]:
    """One rank of ``corun``. Collective."""
    import torch
    import torch.distributed as dist

    from ..tasks import load_task
    from .machinery_kinds import build_runner
    from .timing import sample_batch

    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo")
    name, data_dir, options = spec["task"]
    task = load_task(name, data_dir=data_dir, options=options)
    x, y = sample_batch(task, spec["batch"])
    run = build_runner("plain", task, x, y, spec)

    def mean_step(seconds: float) -> float:
        """Seconds per step over a window: a mean, not a median, since the time slices that
        sharing costs fall on some steps only (a step shorter than a slice mostly runs whole)."""
        steps, start = 0, time.perf_counter()
        while steps < 5 or time.perf_counter() - start < seconds:
            run()
            steps += 1
        return (time.perf_counter() - start) / steps

    mean_step(0.0)  # warm-up, all at once
    dist.barrier()
    alone = mean_step(spec["budget_s"] / 2) if dist.get_rank() == 0 else None
    dist.barrier()
    together = mean_step(spec["budget_s"])
    dist.barrier()
    dist.destroy_process_group()
    return {"alone": alone, "together": together}


DRIFT_STRETCHES = (4, 16)
"""At least 4, at most 16 stretches in ``_drift``'s budget: on the bed the slower rank changed from
one stretch of about ten steps to the next (benchmarks/localsgd_drift.py)."""


def drift_stretches(run: Callable[[], Any], steps: int, budget_s: float) -> list[tuple[float, float]]:
    """Collective (a world of several). Stretches of ``steps`` plain steps on every rank at once,
    each started by a barrier and with no meeting inside (local SGD's steps between averagings):
    (the slowest rank's seconds, the ranks' mean) per stretch."""
    import torch
    import torch.distributed as dist

    out: list[tuple[float, float]] = []
    start = time.perf_counter()
    while agree(len(out) < DRIFT_STRETCHES[0] or (len(out) < DRIFT_STRETCHES[1] and time.perf_counter() - start < budget_s)):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        took = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(took, torch.tensor([time.perf_counter() - t0], dtype=torch.float64))
        each = [t.item() for t in took]
        out.append((max(each), statistics.mean(each)))
    return out


def agree(go: bool) -> bool:
    """Rank 0's ``go`` on every rank (the ranks' kinds talk to each other: they stop together)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return go
    flag = torch.tensor([1.0 if go else 0.0])
    dist.broadcast(flag, 0)
    return bool(flag.item())
