"""Re-sharding a user's DataLoader, and moving its batches to the device."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler, TensorDataset

from ..errors import ConfigError
from .sampler import ShardSampler


def reshard(loader: DataLoader, *, rank: int, world_size: int, seed: int, shuffle: bool | None = None) -> DataLoader:
    """A copy of ``loader`` whose sampler is this rank's ``ShardSampler``."""
    if loader.batch_size is None:
        raise ConfigError(
            "setup_dataloader needs a DataLoader built with batch_size (not a custom batch_sampler); "
            "give the DataLoader batch_size=... instead."
        )
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler, ShardSampler)):
        raise ConfigError(
            f"setup_dataloader replaces the sampler, but this DataLoader has a custom "
            f"{type(loader.sampler).__name__}; pass shuffle=True/False and no sampler instead."
        )
    if shuffle is None:
        shuffle = isinstance(loader.sampler, RandomSampler) or (
            isinstance(loader.sampler, ShardSampler) and loader.sampler.shuffle
        )
    # A data set that declares ``epoch_keyed = True`` takes (seed, epoch, index) keys (see ShardSampler).
    keyed = bool(getattr(loader.dataset, "epoch_keyed", False))
    sampler = ShardSampler(len(loader.dataset), rank=rank, world_size=world_size, shuffle=shuffle, seed=seed, keyed=keyed)
    # Its own generator: creating an iterator then draws no number from the global torch RNG,
    # which would shift the stream (dropout, ...) of a run resumed mid-epoch.
    generator = torch.Generator()
    return DataLoader(
        loader.dataset,
        generator=generator,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        persistent_workers=loader.persistent_workers,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
    )


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity (which respects taskset and cgroup
    cpusets) where the platform has one, else the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_num_workers(dataset: Dataset, local_size: int, cpus: int | None = None) -> int:
    """DataLoader workers per process when none are asked for: 0 for a data set in memory; else
    the process's share of the cores less one for its compute, at most 8 (decode rarely scales further)."""
    if isinstance(dataset, TensorDataset) or getattr(dataset, "in_memory", False):
        return 0
    if cpus is None:
        cpus = usable_cores()
    spare = cpus // max(1, local_size) - 1
    return min(8, spare) if spare >= 1 else 0


def loader_options(num_workers: int, device: torch.device, prefetch_factor: int = 2) -> dict[str, Any]:
    """DataLoader keywords: pinned memory on CUDA (the copy then overlaps compute); with workers,
    workers that live across epochs and ``prefetch_factor`` batches in flight each."""
    options: dict[str, Any] = {"num_workers": num_workers, "pin_memory": device.type == "cuda"}
    if num_workers > 0:
        options.update(persistent_workers=True, prefetch_factor=prefetch_factor)
        # A spawned process (dtrain run's launchers) inherits "spawn" as its start method, so each
        # worker would import torch and the task again (seconds before the first batch); on Linux,
        # fork, as a torchrun-started process gets by default.
        if sys.platform.startswith("linux") and "fork" in mp.get_all_start_methods():
            options["multiprocessing_context"] = "fork"
    return options


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [to_device(b, device) for b in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class DeviceLoader:
    """Iterates a DataLoader and moves batches to the device; ``on_last(flag)`` is told when the
    epoch's last batch is handed out (and when a new epoch starts), ``on_batch()`` when any batch is."""

    def __init__(self, loader: DataLoader, device: torch.device, on_last: Callable[[bool], None], world_size: int = 1,
                 on_batch: Callable[[], None] | None = None) -> None:
        self.loader = loader
        self.device = device
        self._on_last = on_last
        self._on_batch = on_batch
        self.world_size = world_size
        self._epoch_start = 0  # global offset where the epoch in progress began
        self._yielded = 0  # batches handed out in the epoch in progress
        self._len = 0  # batches in the epoch in progress
        # An iteration started and not yet ended: only then does the position follow the
        # batches handed out; otherwise it is where the next iteration will start (the sampler's).
        self._active = False
        self._fixed: Any = None  # the batch of a data set with ``device_batch``, on the device

    @property
    def last_batch(self) -> tuple[int, list[int], list[int] | None]:
        """The epoch and sample indices of the batch handed out last; on an epoch's last batch
        also the indices of this rank's share that ``drop_last`` left out (else None)."""
        b, order = self.loader.batch_size, self.sampler.order
        done = self._yielded * b
        dropped = order[done:] if self._yielded == self._len else None
        return self.sampler.epoch, order[done - b:done], dropped

    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def sampler(self) -> ShardSampler:
        return self.loader.sampler

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        n = self._len = len(self.loader)
        self._on_last(False)
        move = self.device.type != "cpu"
        self._epoch_start, self._yielded, self._active = self.sampler.start, 0, True
        if self.loader.generator is not None:  # workers' seeds follow (seed, epoch, rank), not history
            s = self.sampler
            self.loader.generator.manual_seed((s.seed * 1_000_003 + s._next_epoch) * 4099 + s.rank)
        for i, batch in enumerate(self._batches(move), start=1):
            if i == n:
                self._on_last(True)
            self._yielded = i
            if self._on_batch is not None:
                self._on_batch()  # the stall watchdog's heartbeat
            yield batch
        self._active = False

    def _batches(self, move: bool) -> Iterator[Any]:
        """The DataLoader's batches on the device; for a data set that makes its own batch
        (``device_batch``) that batch, made and moved once, for every index batch of the sampler:
        the model's cost alone, while epochs, positions and the ledger advance as with real data."""
        make = getattr(self.dataset, "device_batch", None)
        if make is None:
            for batch in self.loader:
                yield to_device(batch, self.device) if move else batch
            return
        if self._fixed is None or len(self._fixed[0]) != self.loader.batch_size:
            self._fixed = to_device(make(self.loader.batch_size), self.device)
        for _ in self.loader.batch_sampler:
            yield self._fixed

    def state_dict(self) -> dict[str, int]:
        """The epoch and how many samples of its global order all ranks together have consumed (a
        position any world size can resume from). Between iterations, where the next one starts:
        a run saved again before its first batch keeps the position it resumed from."""
        seed = self.sampler.seed
        if not self._active:
            return {"epoch": self.sampler._next_epoch, "samples_consumed": self.sampler.start, "seed": seed}
        consumed = self._epoch_start + self._yielded * self.loader.batch_size * self.world_size
        if consumed >= len(self.dataset):
            return {"epoch": self.sampler.epoch + 1, "samples_consumed": 0, "seed": seed}
        return {"epoch": self.sampler.epoch, "samples_consumed": consumed, "seed": seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next iteration continues ``state``'s epoch where it stood; an iteration in
        progress is abandoned (``state_dict`` reports ``state`` until the next one starts)."""
        self.sampler.seed = int(state["seed"])
        self.sampler.start_at(int(state["epoch"]), int(state["samples_consumed"]))
        self._active = False

    @property
    def next_epoch(self) -> int:
        """The epoch the next iteration will run."""
        return self.sampler._next_epoch

    def full_epoch_len(self) -> int:
        """Batches in a whole epoch (not a resumed part of one)."""
        per_rank = self.sampler._per_rank(len(self.dataset))
        b = self.loader.batch_size
        return per_rank // b if self.loader.drop_last else -(-per_rank // b)
