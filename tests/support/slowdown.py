"""Slowness on demand for the straggler tests and benchmarks, a ``dtrain train`` plugin
(``DTRAIN_PLUGIN``): ``DTRAIN_SLOW_INJECT=RANK:KIND[:MS]`` slows that rank down. ``input`` sleeps MS
before each batch is handed over (the step's data wait), ``compute`` sleeps MS in each forward,
``hog`` runs a thread of pure-Python work in its process. ``env(spec)`` gives a run both variables."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from dtrain.context.step import DtrainModule
from dtrain.errors import ConfigError
from dtrain.train.listeners import Listener, LoopState
from tests.paths import ROOT

VAR = "DTRAIN_SLOW_INJECT"
KINDS = ("input", "compute", "hog")


def env(spec: str) -> dict[str, str]:
    """The variables of a run slowed by ``spec`` (this checkout on the workers' Python path)."""
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return {"DTRAIN_PLUGIN": __name__, VAR: spec, "PYTHONPATH": path}


def parse(text: str | None) -> tuple[int, str, float] | None:
    if not text:
        return None
    parts = text.split(":")
    try:
        rank, kind, ms = int(parts[0]), parts[1], float(parts[2]) if len(parts) > 2 else 0.0
    except (ValueError, IndexError):
        raise ConfigError(f"{VAR}={text!r} is not RANK:KIND[:MS]; e.g. 1:input:50, 1:compute:20 or 1:hog.") from None
    if kind not in KINDS:
        raise ConfigError(f"{VAR} kind {kind!r} is unknown; choose input, compute or hog.")
    return rank, kind, ms


class SlowDown(Listener):
    """This rank's slowness from ``on_start`` until ``on_end``."""

    def __init__(self, ctx: Any, kind: str, ms: float) -> None:
        self.ctx, self.kind, self.seconds = ctx, kind, ms / 1000.0
        self._stop = threading.Event()
        self._undo: list[Any] = []

    def on_start(self, state: LoopState) -> None:
        if self.kind == "input":  # the loop marks the batch's arrival right after its loader hands it over
            breakdown = self.ctx.breakdown
            got_batch = breakdown.got_batch
            breakdown.got_batch = lambda: (time.sleep(self.seconds), got_batch())
            self._undo.append(lambda: delattr(breakdown, "got_batch"))
        elif self.kind == "compute":  # the model ctx.setup returned: one sleep per forward
            hook = torch.nn.modules.module.register_module_forward_pre_hook(
                lambda module, args: time.sleep(self.seconds) if isinstance(module, DtrainModule) else None)
            self._undo.append(hook.remove)
        else:
            thread = threading.Thread(target=self._hog, name="dtrain-slow-inject-hog", daemon=True)
            thread.start()
            self._undo.append(lambda: (self._stop.set(), thread.join()))

    def _hog(self) -> None:
        # Pure Python, as a busy helper thread of a training script would be: it holds the GIL
        # each switch interval, so this rank alone slows down (matrix products would release
        # the GIL and, on shared cores, slow every rank alike).
        x = 0
        while not self._stop.is_set():
            for i in range(10_000):
                x = (x + i * i) % 1_000_003

    def on_end(self, state: LoopState) -> None:
        while self._undo:
            self._undo.pop()()


def listeners(ctx: Any) -> list[Listener]:
    """The plugin's entry point (``dtrain.train.listeners.plugin``)."""
    spec = parse(os.environ.get(VAR))
    return [SlowDown(ctx, spec[1], spec[2])] if spec is not None and spec[0] == ctx.rank else []
