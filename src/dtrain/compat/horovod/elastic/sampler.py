"""``hvd.elastic.ElasticSampler``: this rank's share of the samples an epoch has not yet processed,
re-split over the world size after every reset. Rank r takes r, r+W, ... of one permutation per
epoch, so the processed samples are always its first ``processed_num``: that count is the state.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import Sampler

from dtrain.data.sampler import ShardSampler

from .. import _basics


class ElasticSampler(Sampler[int]):
    """Partitions ``dataset`` across ranks; ``record_batch`` after each step, ``set_epoch`` at
    the end of each epoch, and keep it in the ``TorchState`` so a reset re-splits what is left."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        """Samples of this epoch processed by all ranks together (the first ones of its order)."""
        self.num_replicas = 1
        self.rank = 0
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self._order: ShardSampler | None = None
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` with nothing processed. Call it at the end of an epoch (not at the
        start), so that a reset in the middle of one does not process samples twice."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """One step of ``batch_size`` samples on every rank is done (Horovod's call)."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Any) -> None:
        """``indices``, this rank's samples of one step, are done (Horovod <= 0.22's call)."""
        self.processed_num += len(indices) * self.num_replicas

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's indices of batch ``batch_idx`` of the current iteration."""
        return self.indices[batch_idx * batch_size: (batch_idx + 1) * batch_size]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Take this process's rank and the world size now, and split what is left of the epoch."""
        initialized = _basics.is_initialized()
        self.num_replicas = _basics.size() if initialized else 1
        self.rank = _basics.rank() if initialized else 0
        self._order = ShardSampler(len(self.dataset), rank=self.rank, world_size=self.num_replicas,
                                   shuffle=self.shuffle, seed=self.seed)
        remaining = max(0, len(self.dataset) - self.processed_num)
        self.num_samples = -(-remaining // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        assert self._order is not None
        start = min(self.processed_num, len(self.dataset))
        # Padded with the epoch's first remaining samples to a multiple of the world size, so
        # every rank runs the same number of steps (as torch's DistributedSampler).
        self.indices = self._order.global_order(self.epoch, start)[self.rank:: self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
