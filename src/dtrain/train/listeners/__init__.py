"""The training loop's listeners: each concern the loop serves besides the step itself is one
object with hooks the loop calls, in a fixed order, after every optimizer step.

    samples ledger -> DTRAIN_PLUGIN's -> loss window -> divergence -> report -> preemption -> checkpoints

Each module holds one listener and is tested alone (tests/logic/train/test_train_listeners.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoopState:
    """What the loop shares with its listeners: they read it, and some set a field (said where)."""

    step: int
    """Optimizer steps done (counted across restarts: a resumed run starts at the checkpoint's)."""
    total: int
    """The step the run ends at."""
    start_step: int = 0
    """The step this process started at (0, or the resumed checkpoint's)."""
    epoch: int = 0
    window_loss: Any = None
    """This rank's loss summed over the steps since the last log (a 0-d tensor on the device)."""
    window_steps: int = 0
    logged: bool = False
    """Set by the loss window: this step ends a log interval and ``last_loss`` is its mean over ranks."""
    last_loss: float = math.nan
    stop: bool = False
    """Set by preemption: the loop ends after this step."""
    extra: dict[str, Any] = field(default_factory=dict)


class Listener:
    """Hooks of the loop; each does nothing unless a listener overrides it."""

    def on_start(self, state: LoopState) -> None:
        """Before the first step (after a resume)."""

    def on_step(self, state: LoopState) -> None:
        """After each optimizer step, in the listeners' order. Collective where a listener says so."""

    def on_end(self, state: LoopState) -> None:
        """After the last step (or a preemption), before the final evaluation."""


class Listeners(Listener):
    """Several listeners called in the order given."""

    def __init__(self, listeners: Sequence[Listener]) -> None:
        self.listeners = list(listeners)

    def on_start(self, state: LoopState) -> None:
        for listener in self.listeners:
            listener.on_start(state)

    def on_step(self, state: LoopState) -> None:
        for listener in self.listeners:
            listener.on_step(state)

    def on_end(self, state: LoopState) -> None:
        for listener in self.listeners:
            listener.on_end(state)


__all__ = ["Listener", "Listeners", "LoopState"]
