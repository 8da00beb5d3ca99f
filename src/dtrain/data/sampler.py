"""Samplers that split a data set between ranks.

``ShardSampler`` (training) pads one permutation per epoch (seeded by ``seed + epoch``) to a
multiple of the world size and gives rank r the indices r, r+W, ...: W ranks with batch B then
see the same samples per step as one process with batch W*B. Each ``iter()`` starts the next
epoch, so no ``set_epoch`` call is needed. ``keyed=True`` yields ``(seed, epoch, index)`` for a
data set whose augmentation is seeded by the sample's key, so a crop does not depend on the
DataLoader worker that reads it.

``EvalShardSampler`` never pads: the ranks together see every sample exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from ..errors import ConfigError


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} / world size {world_size} is not a valid shard.")


class ShardSampler(Sampler[int]):
    """This rank's share of a data set, reshuffled every epoch, resumable."""

    def __init__(
        self,
        length: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        keyed: bool = False,
    ) -> None:
        _check_rank(rank, world_size)
        self.keyed = keyed
        self.length = length
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = -1
        """The epoch of the iteration in progress (-1 before the first)."""
        self._next_epoch = 0
        self._skip = 0
        self._start = 0
        self.order: list[int] = []
        """This rank's indices in the iteration in progress (what the samples ledger records)."""

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration use ``epoch``'s permutation."""
        self._next_epoch = epoch

    def skip(self, n: int) -> None:
        """Leave out the first ``n`` of this rank's indices in the next iteration (resume mid-epoch)."""
        self._skip = n

    def start_at(self, epoch: int, offset: int) -> None:
        """Make the next iteration ``epoch``'s, starting ``offset`` samples into its global order
        (the samples every rank together consumed before), split over this world size."""
        self._next_epoch = epoch
        self._start = max(0, min(offset, self.length))

    @property
    def start(self) -> int:
        """Global offset at which the next iteration begins."""
        return self._start

    def _per_rank(self, remaining: int) -> int:
        if self.drop_last:
            return remaining // self.world_size
        return -(-remaining // self.world_size)

    def __len__(self) -> int:
        return self._per_rank(self.length - self._start)

    def permutation(self, epoch: int) -> list[int]:
        """Every index once, in ``epoch``'s order (the same on every rank)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            return torch.randperm(self.length, generator=g).tolist()
        return list(range(self.length))

    def global_order(self, epoch: int, start: int = 0) -> list[int]:
        """``epoch``'s permutation from ``start`` on, padded or trimmed to a multiple of the world size."""
        order = self.permutation(epoch)[start:]
        total = self._per_rank(len(order)) * self.world_size
        if total <= len(order):
            return order[:total]
        pad = total - len(order)
        return order + (order * (pad // max(1, len(order)) + 1))[:pad]

    def __iter__(self) -> Iterator[int]:
        self.epoch = self._next_epoch
        self._next_epoch += 1
        skip, self._skip = self._skip, 0
        start, self._start = self._start, 0
        order = self.order = self.global_order(self.epoch, start)[self.rank :: self.world_size][skip:]
        if self.keyed:
            seed, epoch = self.seed, self.epoch
            return iter([(seed, epoch, i) for i in order])
        return iter(order)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "next_epoch": self._next_epoch, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self._next_epoch = int(state["next_epoch"])
        self.seed = int(state["seed"])


class EvalShardSampler(Sampler[int]):
    """Rank r takes indices r, r+W, ...; no padding, so the ranks together see each sample once."""

    def __init__(self, length: int, *, rank: int = 0, world_size: int = 1) -> None:
        _check_rank(rank, world_size)
        self.length = length
        self.rank = rank
        self.world_size = world_size

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.world_size))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.world_size))
