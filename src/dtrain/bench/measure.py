"""The measured loop's bookkeeping, shared by the dtrain worker and the plain reference so that
both are timed the same way."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..metrics.memory import peak_memory

PHASES = ("data_wait", "forward_backward", "comm_wait", "optimizer")


@dataclass
class Recorder:
    """Per-step phase times (ms), per-repeat wall times and the loss curve of one rank."""

    rank: int
    world_size: int
    method: str
    batch_size: int
    device: str
    steps: list[list[float]] = field(default_factory=list)
    """One [data_wait, forward_backward, comm_wait, optimizer] row (ms) per measured step."""
    repeats: list[float] = field(default_factory=list)
    """Wall seconds of each measured repeat."""
    steps_per_repeat: int = 0
    warmup_s: float | None = None
    """Wall seconds of the warm-up steps: kept out of every rate, reported apart."""
    compute_only_ms: list[float] = field(default_factory=list)
    """forward+backward times (ms) of steps run without gradient communication."""
    loss_curve: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since training started, loss) for every step, warm-up included."""
    comm_bytes_per_step: float | None = None
    final_loss: float | None = None
    test_acc: float | None = None
    """The task's metric on its test set (named ``metric_name``: test_acc, or lm's val_loss)."""
    metric_name: str = "test_acc"
    tokens_per_sample: int | None = None
    """Tokens per sample of a sequence task (lm): the report adds tokens/s."""
    peak_mem_mib: float | None = None
    train_samples: int | None = None
    """Samples in the task's training set: the report turns samples/s into seconds per epoch."""
    replicas: int | None = None
    """Ranks that read their own samples (the world size, but 1 under pipeline)."""
    state_bytes: dict[str, int] | None = None
    """This rank's parameter, gradient and optimizer-state bytes after the first step."""
    mem_kind: str = "rss"
    breakdown: dict[str, Any] | None = None
    """dtrain's own step breakdown of the measured steps (dtrain methods only)."""
    batch_split: list[dict[str, Any]] | None = None
    """``--batch-split speed``: every change of the shares (step, from step, old, new, why)."""
    threads: int = field(default_factory=torch.get_num_threads)
    start: float = field(default_factory=time.perf_counter)

    def clock(self) -> float:
        """Seconds, after waiting for the device so GPU work is inside the phase that queued it."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter()

    def add_step(self, t0: float, t_data: float, t_fb: float, t_comm: float, t_end: float, loss: float, measured: bool) -> None:
        if measured:
            self.steps.append([(t_data - t0) * 1e3, (t_fb - t_data) * 1e3, (t_comm - t_fb) * 1e3, (t_end - t_comm) * 1e3])
        self.loss_curve.append((round(t_end - self.start, 4), loss))

    def time_repeats(self, step: Callable[[bool], None], args: Any, barrier: Callable[[], Any],
                     after_warmup: Callable[[], None] | None = None) -> None:
        """``args.warmup`` steps unmeasured, then ``args.repeats`` repeats of ``args.steps`` measured
        steps, every rank starting each repeat together, so a repeat's time is the slowest rank's."""
        t_warm = self.clock()
        for _ in range(args.warmup):
            step(False)
        self.warmup_s = round(self.clock() - t_warm, 4)
        self.steps_per_repeat = args.steps
        if after_warmup is not None:
            after_warmup()
        for _ in range(args.repeats):
            barrier()
            start = self.clock()
            for _ in range(args.steps):
                step(True)
            self.repeats.append(self.clock() - start)

    def finish(self) -> None:
        peak, self.mem_kind = peak_memory(torch.device(self.device))
        self.peak_mem_mib = peak / 2**20

    def write(self, folder: str) -> str:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}.json")
        data = asdict(self)
        data.pop("start")
        with open(path, "w") as fh:
            json.dump(data, fh)
        return path


def grad_payload_bytes(model: torch.nn.Module) -> int:
    """Bytes of gradients one rank hands to all-reduce per synchronised step (DDP reduces every
    trainable parameter's gradient, in the parameter's dtype)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def forever(loader: Any):
    """Batches without end: a new pass (a new, reshuffled epoch) when one ends."""
    while True:
        yielded = False
        for batch in loader:
            yielded = True
            yield batch
        if not yielded:
            raise RuntimeError("the data loader is empty")


def worker_parser():
    """Arguments of both bench workers (the runner passes the same ones to each)."""
    import argparse

    p = argparse.ArgumentParser(description="one method of dtrain bench (started by `dtrain bench`)")
    p.add_argument("--method", required=True)
    p.add_argument("--task", default="digits")
    p.add_argument("--task-arg", action="append", default=[])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--parallel", default=None)
    p.add_argument("--comm", default=None)
    p.add_argument("--batch-split", default=None)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--num-workers", type=int, default=None)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compute-steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--out", required=True)
    return p


def task_options(pairs: list[str]) -> dict[str, str]:
    return dict(pair.partition("=")[::2] for pair in pairs)
