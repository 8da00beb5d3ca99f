"""The fault driver of the tests and benchmarks, a ``dtrain train`` plugin (``DTRAIN_PLUGIN``):
``DTRAIN_FAULT_INJECT=RANK:STEP`` makes that rank kill itself (SIGKILL) right after that step, on
the first attempt only (restarts then resume normally). ``env(rank, step)`` gives a run both."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

from dtrain.errors import ConfigError
from dtrain.train.listeners import Listener, LoopState
from tests.paths import ROOT

VAR = "DTRAIN_FAULT_INJECT"


def env(rank: int, step: int) -> dict[str, str]:
    """The variables of a run whose rank ``rank`` dies after step ``step`` (this checkout's root on
    the workers' Python path, so they import this module)."""
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return {"DTRAIN_PLUGIN": __name__, VAR: f"{rank}:{step}", "PYTHONPATH": path}


def parse(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        rank, step = (int(v) for v in text.split(":"))
    except ValueError:
        raise ConfigError(f"{VAR}={text!r} is not RANK:STEP (e.g. 1:25).") from None
    return rank, step


def fault_step(fault: tuple[int, int] | None, rank: int, restarts: int) -> int | None:
    """The step after which this rank dies, or None."""
    if fault is None or restarts > 0:
        return None
    return fault[1] if fault[0] == rank else None


class FaultInjection(Listener):
    def __init__(self, step: int, kill: Callable[[], None] | None = None) -> None:
        self.step = step
        self._kill = kill or (lambda: os.kill(os.getpid(), signal.SIGKILL))

    def on_step(self, state: LoopState) -> None:
        if state.step == self.step:
            self._kill()  # a crash, as a lost machine would be


def listeners(ctx: Any) -> list[Listener]:
    """The plugin's entry point (``dtrain.train.listeners.plugin``)."""
    step = fault_step(parse(os.environ.get(VAR)), ctx.rank, ctx.world.restart_count)
    return [FaultInjection(step)] if step is not None else []
