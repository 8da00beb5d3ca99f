"""Each rank's share of the global batch, when the shares differ (``--batch-split``; ``split.py``).

The even sampler (``ShardSampler``) gives rank r the positions r, r+W, ... of the epoch's order,
so its step s covers positions ``[s*G, (s+1)*G)`` of that order (``G`` = W x the batch). This one
covers the same positions in each step, cut in consecutive pieces instead: rank r takes
``shares[r]`` of them after the shares of ranks 0..r-1. The epoch's order (the same permutation,
padded as the even sampler pads it), its number of steps and the position saved in checkpoints
(samples of the global order consumed, ``DeviceLoader.state_dict``) are the even split's, so
every sample is trained on exactly once per epoch whatever the shares, a checkpoint of one
resumes in the other, and a change of shares mid-epoch loses or repeats nothing.

The shares of each step come from a ``SplitSchedule`` read as the batch is built; the sampler
counts the steps it builds (``next_step``), which runs ahead of training by the batches in
flight (DataLoader workers prefetch), so a change is made for a step no rank has built yet.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from .loader import DeviceLoader, to_device
from .sampler import ShardSampler
from .split import SplitSchedule, even_shares


class SplitBatchSampler(Sampler[list[int]]):
    """This rank's batches: per step, its share of the step's ``G`` positions of the epoch's order."""

    def __init__(self, shard: ShardSampler, schedule: SplitSchedule, *, batch_size: int) -> None:
        self.shard = shard
        self.schedule = schedule
        self.batch_size = batch_size
        """The even split's batch of one rank (``G`` / W)."""
        self.global_batch = batch_size * shard.world_size
        self.next_step = 1
        """The step number of the next batch this sampler builds (set from the loop's step on start)."""
        self.batches: list[list[int]] = []
        """This rank's index batches of the iteration in progress, as built (the ledger reads them)."""
        self.tail: list[int] = []
        """The positions of the epoch's order left after its last whole global batch (drop_last)."""

    def __len__(self) -> int:
        return self.shard._per_rank(self.shard.length - self.shard.start) // self.batch_size

    def __iter__(self) -> Iterator[list[Any]]:
        s = self.shard
        s.epoch = epoch = s._next_epoch  # the epoch bookkeeping of ShardSampler.__iter__
        s._next_epoch += 1
        start, s._start, s._skip = s._start, 0, 0
        order = s.global_order(epoch, start)
        steps, g = len(order) // self.global_batch, self.global_batch
        self.batches = []
        self.tail = order[steps * g:]
        return self._batches(order, steps, epoch)

    def _batches(self, order: list[int], steps: int, epoch: int) -> Iterator[list[Any]]:
        g, rank, keyed, seed = self.global_batch, self.shard.rank, self.shard.keyed, self.shard.seed
        for j in range(steps):
            shares = self.schedule.at(self.next_step)
            self.next_step += 1
            first = j * g + sum(shares[:rank])
            batch = order[first:first + shares[rank]]
            self.batches.append(batch)
            yield [(seed, epoch, i) for i in batch] if keyed else batch


class SplitLoader(DeviceLoader):
    """A ``DeviceLoader`` whose rank batches follow a ``SplitSchedule``; built from the even one
    that ``ctx.setup_dataloader`` returned (its data set, sampler and DataLoader options)."""

    def __init__(self, even: DeviceLoader, schedule: SplitSchedule) -> None:
        inner, shard = even.loader, even.sampler
        self.batch_sampler = SplitBatchSampler(shard, schedule, batch_size=inner.batch_size)
        loader = DataLoader(inner.dataset, batch_sampler=self.batch_sampler, num_workers=inner.num_workers,
                            collate_fn=inner.collate_fn, pin_memory=inner.pin_memory, timeout=inner.timeout,
                            worker_init_fn=inner.worker_init_fn, multiprocessing_context=inner.multiprocessing_context,
                            generator=torch.Generator(), persistent_workers=inner.persistent_workers,
                            prefetch_factor=inner.prefetch_factor if inner.num_workers > 0 else None)
        super().__init__(loader, even.device, even._on_last, world_size=even.world_size, on_batch=even._on_batch)
        self.schedule = schedule
        self.restored = False
        self.fixed = False
        """Fixed shares (``--batch-split 40,24``): a checkpoint's schedule is not taken."""
        """The schedule came from a checkpoint of this world size and global batch (no need to measure)."""
        self._fixed_by_size: dict[int, Any] = {}

    @property
    def sampler(self) -> ShardSampler:
        return self.batch_sampler.shard

    @property
    def batch_size(self) -> int:
        """The even split's batch of one rank: positions advance by ``batch_size * world_size`` a step."""
        return self.batch_sampler.batch_size

    @property
    def last_batch(self) -> tuple[int, list[int], list[int] | None]:
        """The epoch and indices of the batch handed out last; on the epoch's last batch, what
        ``drop_last`` left of the epoch's order (rank 0 names it, the others an empty list)."""
        bs = self.batch_sampler
        last = self._yielded == self._len
        dropped = (bs.tail if self.sampler.rank == 0 else []) if last else None
        return self.sampler.epoch, bs.batches[self._yielded - 1], dropped

    def full_epoch_len(self) -> int:
        return self.sampler._per_rank(len(self.dataset)) // self.batch_size

    def _batches(self, move: bool) -> Any:
        make = getattr(self.dataset, "device_batch", None)
        if make is None:
            yield from super()._batches(move)
            return
        for index_batch in self.loader.batch_sampler:  # one batch made once per size (see DeviceLoader._batches)
            n = len(index_batch)
            if n not in self._fixed_by_size:
                self._fixed_by_size[n] = to_device(make(n), self.device)
            yield self._fixed_by_size[n]

    def start_step(self, step: int) -> None:
        """The loop's step count before its next batch (``step`` steps done)."""
        self.batch_sampler.next_step = step + 1

    def state_dict(self) -> dict[str, Any]:
        """``DeviceLoader.state_dict``'s position (a step consumes ``G`` positions whatever the
        shares), and the schedule."""
        s = self.sampler
        if not self._active:
            position = {"epoch": s._next_epoch, "samples_consumed": s.start, "seed": s.seed}
        else:
            consumed = self._epoch_start + self._yielded * self.batch_sampler.global_batch
            done = consumed >= len(self.dataset)
            position = {"epoch": s.epoch + done, "samples_consumed": 0 if done else consumed, "seed": s.seed}
        return {**position, "split": {"world_size": self.world_size, "global_batch": self.batch_sampler.global_batch,
                                                   "schedule": self.schedule.state()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The position, and the schedule where the checkpoint is of this world size and global
        batch (not for fixed shares: the ones given now hold)."""
        super().load_state_dict(state)
        saved = state.get("split")
        if saved and not self.fixed and saved.get("world_size") == self.world_size and saved.get("global_batch") == self.batch_sampler.global_batch:
            self.schedule.entries = SplitSchedule.from_state(saved["schedule"]).entries
            self.restored = True



def split_loader(even: DeviceLoader, shares: list[int] | None = None) -> SplitLoader:
    """The ``SplitLoader`` over ``even``'s data with fixed ``shares``, or (None) starting even
    for a split measured by speed."""
    world = even.world_size
    start = shares if shares is not None else even_shares(even.loader.batch_size * world, world)
    loader = SplitLoader(even, SplitSchedule(start))
    loader.fixed = shares is not None
    return loader
