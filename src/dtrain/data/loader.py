"""Re-sharding a user's DataLoader, and moving its batches to the device."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

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
    sampler = ShardSampler(len(loader.dataset), rank=rank, world_size=world_size, shuffle=shuffle, seed=seed)
    return DataLoader(
        loader.dataset,
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
    epoch's last batch is handed out (and when a new epoch starts)."""

    def __init__(self, loader: DataLoader, device: torch.device, on_last: Callable[[bool], None]) -> None:
        self.loader = loader
        self.device = device
        self._on_last = on_last

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
        n = len(self.loader)
        self._on_last(False)
        move = self.device.type != "cpu"
        for i, batch in enumerate(self.loader, start=1):
            if i == n:
                self._on_last(True)
            yield to_device(batch, self.device) if move else batch
