"""Fault injection for fault-tolerance tests: ``DTRAIN_FAULT_INJECT=RANK:STEP`` makes that rank
kill itself (SIGKILL) right after that step, on the first attempt only (restarts then resume
normally)."""

from __future__ import annotations

import os
import signal

from . import Listener, LoopState


def fault_step(fault: tuple[int, int] | None, rank: int, restarts: int) -> int | None:
    """The step after which this rank dies, or None."""
    if fault is None or restarts > 0:
        return None
    return fault[1] if fault[0] == rank else None


class FaultInjection(Listener):
    def __init__(self, step: int, kill: object = None) -> None:
        self.step = step
        self._kill = kill or (lambda: os.kill(os.getpid(), signal.SIGKILL))

    def on_step(self, state: LoopState) -> None:
        if state.step == self.step:
            self._kill()  # a crash, as a lost machine would be
