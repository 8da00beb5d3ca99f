"""Checkpoints as a listener: one every ``save_every`` steps, and one at the end (``--checkpoint-dir``)."""

from __future__ import annotations

from typing import Any

from ..._log import logger
from . import Listener, LoopState


class Checkpoints(Listener):
    def __init__(self, manager: Any, *, save_every: int | None, objects: dict[str, Any], breakdown: Any = None,
                 is_main: bool = False, async_save: bool = False) -> None:
        self.manager, self.save_every, self.objects = manager, save_every, objects
        self.breakdown, self.is_main, self.async_save = breakdown, is_main, async_save
        self.blocked_s = 0.0
        """Seconds training was held by saves."""

    def due(self, state: LoopState) -> bool:
        return bool(self.save_every) and state.step % self.save_every == 0 and state.step < state.total

    def save(self, step: int) -> None:
        """Collective: every rank."""
        self.manager.save(step, **self.objects)
        self.blocked_s += self.manager.last_blocking_s or 0.0

    def on_step(self, state: LoopState) -> None:
        if self.due(state):
            self.save(state.step)
            if self.breakdown is not None:
                self.breakdown.lap("checkpoint")

    def on_end(self, state: LoopState) -> None:
        """The last step's checkpoint (a preempted run saved in the signal's hook already), then
        wait for asynchronous saves to land."""
        if not state.stop:
            self.save(state.step)
        self.manager.wait()
        if not state.stop and self.is_main:
            logger.info(f"checkpoints: training was held {self.blocked_s:.3f} s by saves "
                        f"({'asynchronous' if self.async_save else 'synchronous'})")
