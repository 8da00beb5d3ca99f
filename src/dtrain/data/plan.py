"""The input path's defaults for the device and the sample size: DataLoader workers, pinned
memory and batches in flight. Data in memory needs no workers (a worker only adds a copy); on a
CPU, workers get the cores the computing process leaves; on a GPU, the process mostly waits for
the device, so decoding gets every core of its share but one (with 0 workers each batch would be
decoded between steps on the main thread).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, TensorDataset

from .loader import default_num_workers, usable_cores

PREFETCH_BUDGET_BYTES = 2 * 2**30
"""At most this much host memory in batches waiting in the workers' queues, per process."""


@dataclass(frozen=True)
class InputPlan:
    workers: int
    pin_memory: bool
    prefetch_factor: int | None
    """Batches in flight per worker; None without workers."""
    why: str


def plan_input(dataset: Dataset, *, local_size: int, device: torch.device, batch_size: int, workers: int | None = None,
               cpus: int | None = None, sample_bytes: int | None = None) -> InputPlan:
    """The plan for ``dataset`` on ``device`` with ``local_size`` training processes on this node.
    ``workers``: asked for (``--num-workers``); ``cpus``: default counted; ``sample_bytes``: default
    the data set's own ``sample_bytes`` (unknown: torch's prefetch)."""
    pin = device.type == "cuda"
    resident = isinstance(dataset, TensorDataset) or getattr(dataset, "in_memory", False) or hasattr(dataset, "device_batch")
    if workers is None:
        if resident:
            return InputPlan(0, pin, None, "data in memory: no workers")
        cpus = usable_cores() if cpus is None else cpus
        if device.type == "cuda":
            share = cpus // max(1, local_size)
            workers = min(8, max(1, share - 1)) if share >= 1 else 0
            why = f"{cpus} cores for {local_size} GPU process(es): {workers} decoding worker(s) each"
        else:
            workers = default_num_workers(dataset, local_size, cpus)
            why = f"{cpus} cores for {local_size} CPU process(es), one computing: {workers} worker(s) each"
    else:
        why = f"--num-workers {workers}"
    if workers == 0:
        return InputPlan(0, pin, None, why)
    prefetch = 4 if workers <= 2 else 2  # with few workers, a burst of slow samples would empty the queue
    size = sample_bytes if sample_bytes is not None else _sample_bytes(dataset)
    if size:
        fits = PREFETCH_BUDGET_BYTES // max(1, size * batch_size * workers)
        prefetch = max(1, min(prefetch, fits))
    return InputPlan(workers, pin, prefetch, why)


def _sample_bytes(dataset: Dataset) -> int | None:
    """Bytes of one decoded sample, as the data set declares it (``sample_bytes``; the images task
    does); None where unknown. Not measured by reading a sample: a read in the training process
    would draw from its random generator (augmentations) and count an unreadable file twice."""
    value = getattr(dataset, "sample_bytes", None)
    return int(value) if isinstance(value, (int, float)) and value > 0 else None
