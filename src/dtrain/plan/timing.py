"""Timing a training step on the device at hand: its forward, backward and optimizer phases
(``timed_step``, on the host's clock or a GPU's), their medians (``measure``), a batch's fetch.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Timing:
    """Medians measured on the profiling device for one batch of ``batch`` samples."""

    batch: int
    fwd_s: float
    bwd_s: float
    opt_s: float
    threads: int
    device: str
    data_s: float = 0.0
    """Fetching and collating one batch from the (in-memory) data set."""
    checkpointed: bool = False
    """Timed with the blocks checkpointed: the backward holds their recomputation."""


NoCast = contextlib.nullcontext
"""No autocast: the ``cast`` context of an fp32 step."""


def sample_batch(task: Any, batch: int) -> tuple[Any, Any]:
    from torch.utils.data import default_collate

    n = len(task.train_set)
    if n == 0:
        raise ConfigError(f"task {task.name!r} has an empty training set; nothing to profile.")
    return default_collate([task.train_set[i % n] for i in range(batch)])


Runner = Callable[[], tuple[float, float, float]]
WARMUP_GPU = 5
"""Untimed steps before a GPU's timed ones (the allocator, cuBLAS's choices settle)."""


def _clock(gpu: bool) -> tuple[Callable[[], Any], Callable[[Any], None], Callable[[Any, Any], float]]:
    """(mark, wait, seconds between two marks): the host's clock, or the GPU's (a CUDA event
    recorded in the stream's order, read once the last has run)."""
    if not gpu:
        return time.perf_counter, lambda _m: None, lambda a, b: b - a

    def mark() -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return mark, lambda m: m.synchronize(), lambda a, b: a.elapsed_time(b) / 1e3


def timed_step(model: nn.Module, opt: Any, task: Any, x: Any, y: Any, cast: Callable, after: Callable[[], None] | None = None,
               gpu: bool = False) -> Runner:
    """A runner of one training step of ``model`` on (x, y): each call returns its forward, backward and
    optimizer-step (with ``after``) seconds. ``gpu``: each phase timed on the GPU's own clock (CUDA
    events, as the training breakdown times a GPU step) with no wait between phases, so the host
    queues a phase's kernels while the GPU still runs the one before, as in training; one wait, at
    the step's end (a wait before every reading leaves the GPU idle while the host queues)."""
    mark, wait, between = _clock(gpu)

    def run() -> tuple[float, float, float]:
        t0 = mark()
        with cast():
            loss = task.loss_fn(model(x), y)
        t1 = mark()
        loss.backward()
        t2 = mark()
        opt.step()
        if after is not None:
            after()
        opt.zero_grad(set_to_none=True)
        t3 = mark()
        wait(t3)
        return between(t0, t1), between(t1, t2), between(t2, t3)
    return run


def measure(task: Any, x: Any, y: Any, *, optimizer: str, lr: float, autocast_dtype: torch.dtype | None,
            threads: int, repeats: int = 15, budget_s: float = 5.0, device: str = "cpu",
            checkpointed: bool = False) -> Timing:
    """Median forward, backward and optimizer-step times of up to ``repeats`` steps (at least 5;
    fewer once ``budget_s`` is spent) after the warm-up, on CPU with ``threads`` torch threads.
    ``device="cuda"``: on this GPU as `dtrain train --device cuda` runs it, no data time (a GPU
    run's loader works ahead). ``checkpointed``: the blocks recomputed in backward, as training does."""
    from ..parallel.transforms import apply_activation_checkpointing
    from ..tasks import make_optimizer

    gpu = device == "cuda"
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        torch.manual_seed(0)
        model = task.new_model()
        checkpointed = bool(checkpointed and task.blocks is not None
                            and apply_activation_checkpointing(task.blocks(model)))
        if gpu:
            from ..data.loader import to_device

            model, x, y = model.to("cuda"), to_device(x, torch.device("cuda")), to_device(y, torch.device("cuda"))
        opt = make_optimizer(optimizer, model.parameters(), lr, device=torch.device(device))
        kind = "cuda" if gpu else "cpu"
        cast = (lambda: torch.autocast(kind, dtype=autocast_dtype)) if autocast_dtype is not None else NoCast
        run = timed_step(model, opt, task, x, y, cast, gpu=gpu)
        fwd, bwd, step = [], [], []
        warm = WARMUP_GPU if gpu else 2
        start = time.perf_counter()
        for i in range(repeats + warm):
            if i >= warm + 5 and time.perf_counter() - start > budget_s:
                break
            f_s, b_s, o_s = run()
            if i >= warm:
                fwd.append(f_s), bwd.append(b_s), step.append(o_s)
    finally:
        torch.set_num_threads(old)
    batch = len(y) if hasattr(y, "__len__") else 1
    return Timing(batch=batch, fwd_s=statistics.median(fwd), bwd_s=statistics.median(bwd), opt_s=statistics.median(step),
                  threads=threads, device=device, data_s=0.0 if gpu else data_time(task, batch), checkpointed=checkpointed)


def data_time(task: Any, batch: int) -> float:
    """Median seconds to fetch and collate one batch from the task's (in-memory) training set."""
    data = []
    for _ in range(5):
        t0 = time.perf_counter()
        sample_batch(task, batch)
        data.append(time.perf_counter() - t0)
    return statistics.median(data)
