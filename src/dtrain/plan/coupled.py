"""A pipeline layout timed as the job runs it, where the job's processes share this machine's
cores and outnumber them (``Cluster.oversubscribed``): the layout built by dtrain's own
``init(parallel=...)`` and ``ctx.setup`` in a world of the job's processes over loopback, its
schedule (``ctx.forward_backward``) timed step after step.

Scaling a world of two's schedule by the share of the cores misses what couples the job's
processes: each hand-off between stages also waits for its peer to be given a core, and in
``pp x dp`` the pipelines wait for each other at every step's gradient all-reduce, so the
slowest sets the pace. On this machine (2 cores) `dtrain train --task lm --parallel
pp=2,dp_replicate=2 -n 4` ran its schedule 2.55x as long as ``pp=2 -n 2``'s, where time slicing
says 2.0x and four plain steps at once 1.76-2.35x (bed runs 12-14). The link's part (the sends'
bytes beyond loopback) stays the link model's (``steps.pipeline_step``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any


def schedules(task_spec: tuple[str, str | None, dict[str, str]], layouts: list[Any], *, processes: int,
              **options: Any) -> dict[str, tuple[int, float]]:
    """``measure`` of each pipeline layout of ``layouts`` (by name) that `dtrain train` can build."""
    out = {}
    for lay in layouts:
        if lay.dims.pp > 1 and lay.name not in out and (got := measure(task_spec, lay.name, processes=processes, **options)):
            out[lay.name] = got
    return out


def measure(task_spec: tuple[str, str | None, dict[str, str]], layout: str, *, processes: int, batch: int, precision: str,
            optimizer: str, microbatches: int, schedule: str, activation_checkpointing: bool = False, threads: int = 1,
            budget_s: float = 3.0) -> tuple[int, float] | None:
    """(processes, seconds of one step's schedule): the mean over a window of steps, averaged over
    the ranks; None where `dtrain train` would refuse the layout with these settings (a batch the
    micro-batches do not divide, a model it cannot cut), as the plan's own check says."""
    from ..launch.local import run_distributed

    spec = {"task": task_spec, "layout": layout, "batch": batch, "precision": precision, "optimizer": optimizer,
            "microbatches": microbatches, "schedule": schedule, "ac": activation_checkpointing, "threads": threads,
            "budget_s": budget_s}
    got = run_distributed(body, spec, world_size=processes, timeout=180 + 6 * budget_s, env={"OMP_NUM_THREADS": str(threads)})
    return None if None in got else (processes, statistics.mean(got))


def body(spec: dict[str, Any]) -> float | None:
    """One rank: the layout's steps on one sample batch; the mean seconds of its schedule (None:
    the layout refused these settings, alike on every rank). Collective."""
    import torch
    import torch.distributed as dist

    from ..context.startup import init
    from ..errors import ConfigError
    from ..tasks import load_task, make_optimizer
    from .timing import sample_batch

    torch.set_num_threads(spec["threads"])
    name, data_dir, options = spec["task"]
    task = load_task(name, data_dir=data_dir, options=options)
    x, y = sample_batch(task, spec["batch"])
    ctx = init(parallel=spec["layout"], tp_plan=task.tp_plan, precision=spec["precision"], seed=0, stall_timeout=0,
               activation_checkpointing=spec["ac"], microbatches=spec["microbatches"], schedule=spec["schedule"])
    try:
        model = task.new_model()
        opt = make_optimizer(spec["optimizer"], model.parameters(), task.lr, device=ctx.device)

        def step() -> float:
            t0 = time.perf_counter()
            ctx.forward_backward(model, x, y, task.loss_fn)
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return t1 - t0

        try:  # what `dtrain train` refuses (a model it cannot cut, a batch the micro-batches do not
            # divide) it refuses here, alike on every rank, before any transfer
            model, opt = ctx.setup(model, opt, blocks=task.blocks(model) if task.blocks else None)
            start = time.perf_counter()
            step()  # warm-up (3 steps): the schedule's first build, the allocator
        except ConfigError:
            return None
        for _ in range(2):
            step()
        # rank 0's warm-up sets how many steps fill the budget, the same count on every rank
        count = torch.tensor([max(5, min(60, round(spec["budget_s"] / max(1e-3, (time.perf_counter() - start) / 3))))])
        dist.broadcast(count, 0)
        return statistics.mean(step() for _ in range(int(count.item())))
    finally:
        ctx.close()
