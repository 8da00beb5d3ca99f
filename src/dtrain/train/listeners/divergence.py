"""A NaN or infinite training loss stops the job (every rank sees the same reduced value),
before anything is saved: the newest checkpoint stays the last good one."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ...errors import ConfigError
from . import Listener, LoopState


class Diverged(ConfigError):
    """The training loss became NaN or infinite (every rank raises it at the same step)."""


class DivergenceCheck(Listener):
    def __init__(self, ctx: Any, *, lr: float, checkpoint_dir: str | None = None,
                 save_due: Callable[[LoopState], bool] = lambda state: False) -> None:
        self.ctx, self.lr, self.checkpoint_dir, self.save_due = ctx, lr, checkpoint_dir, save_due

    def on_step(self, state: LoopState) -> None:
        """At a log step: the logged mean loss. Before a checkpoint between logs: the largest loss
        of any rank since the last log (never save a diverged model over the last good one).
        Collective then: called on every rank."""
        if state.logged:
            self.check(state.last_loss, state.step)
        elif state.window_steps and self.save_due(state):
            self.check(self.ctx.all_reduce(state.window_loss.clone(), op="max").item(), state.step)

    def check(self, loss: float, step: int) -> None:
        if math.isfinite(loss):
            return
        kept = f"; nothing saved after it, {self.checkpoint_dir} keeps the last good checkpoint" if self.checkpoint_dir else ""
        raise Diverged(
            f"the training loss became {loss} at step {step} (lr {self.lr:g}){kept}; "
            "lower --lr (or use gradient clipping / --precision fp32)."
        )
