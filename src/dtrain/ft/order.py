"""The samples of a fault-tolerant job: one global order per epoch, shared by the replica groups.

Each step takes the next ``participants x batch`` samples of the epoch's order; participant ``r``
trains the ``r``-th slice. The position moves only when the step is committed (a step not committed
is taken again by the next quorum) and travels with a heal, so every group agrees on it. Each group
keeps its ``--batch-size``: the global batch follows the quorum. An epoch's last samples that do not
fill a step are left out (as ``drop_last``) and recorded as dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class StepPlan:
    """What one step trains, before it is committed."""

    epoch: int
    start: int
    """Position in the epoch's order of the step's first sample."""
    step_indices: list[int]
    """Every participant's samples, in participant order."""
    mine: list[int]
    """This replica group's slice."""
    dropped: tuple[int, list[int]] | None = None
    """(epoch, samples) the previous epoch left out, when this step starts a new epoch."""
    done: bool = False
    """The job's epochs are complete: no step."""


class GlobalOrder:
    """The position in the global order (epoch, samples consumed) and the plan of the next step."""

    def __init__(self, n: int, *, seed: int, epochs: int) -> None:
        self.n = n
        self.seed = seed
        self.epochs = epochs
        self.epoch = 0
        self.pos = 0
        self._cache: tuple[int, list[int]] | None = None

    def order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s permutation of the samples: the same on every replica group."""
        if self._cache is None or self._cache[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._cache = (epoch, torch.randperm(self.n, generator=gen).tolist())
        return self._cache[1]

    def plan(self, rank: int, participants: int, batch: int) -> StepPlan:
        """The next step for participant ``rank`` of ``participants``, each training ``batch`` samples."""
        epoch, pos, dropped = self.epoch, self.pos, None
        width = participants * batch
        if self.n - pos < width:  # the rest does not fill a step: the epoch ends here
            dropped = (epoch, self.order(epoch)[pos:])
            epoch, pos = epoch + 1, 0
        if epoch >= self.epochs or width > self.n:
            return StepPlan(epoch=epoch, start=pos, step_indices=[], mine=[], dropped=dropped, done=True)
        indices = self.order(epoch)[pos:pos + width]
        return StepPlan(epoch=epoch, start=pos, step_indices=indices, mine=indices[rank * batch:(rank + 1) * batch],
                        dropped=dropped)

    def commit(self, plan: StepPlan) -> None:
        """The step ``plan`` described was committed: its samples are consumed."""
        self.epoch, self.pos = plan.epoch, plan.start + len(plan.step_indices)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
