"""Steady-state rates: samples/s (and from it tokens/s, TFLOP/s and MFU) over the steps after
warm-up, with the warm-up's cost (compile, autotuning, workers starting) as its own figure
(``warmup_s``); docs/performance.md compares the peers' rules."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .._log import logger

WARMUP_STEPS = 5
"""Steps left out of every rate by default (nanoGPT leaves out 5 for MFU)."""


class SteadyRate:
    """Samples per second after warm-up, per window (log interval) and over the whole run;
    warm-up is at most half of ``steps``. Call ``start()``, ``step_done()`` after each step,
    ``window()`` per log interval and ``finish()`` after the last step."""

    def __init__(self, samples_per_step: int, *, steps: int | None = None, warmup_steps: int | None = None,
                 sync: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        asked = WARMUP_STEPS if warmup_steps is None else warmup_steps
        if asked < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {asked}")
        self.samples_per_step = samples_per_step
        self.warmup_steps = asked if steps is None else min(asked, steps // 2)
        if warmup_steps is not None and self.warmup_steps < warmup_steps:  # the default shrinks quietly
            logger.warning(f"--warmup-steps {warmup_steps} is more than half of this run's {steps} steps; the rates leave "
                           f"out the first {self.warmup_steps} step(s) instead (give --warmup-steps {self.warmup_steps} or "
                           "fewer, or a longer run).")
        self.steps = 0
        self._sync, self._clock = sync, clock
        self._t_start: float | None = None
        self._t_warm: float | None = None  # when warm-up ended
        self._t_end: float | None = None
        self._mark: tuple[int, float] | None = None  # (steps, time) where the current window began

    def start(self) -> None:
        self._t_start = self._clock()
        if self.warmup_steps == 0:
            self._warm_done(self._t_start)

    def _warm_done(self, now: float) -> None:
        self._t_warm = now
        self._mark = (self.steps, now)

    def step_done(self) -> None:
        self.steps += 1
        if self.steps == self.warmup_steps and self._t_warm is None:
            if self._sync is not None:
                self._sync()
            self._warm_done(self._clock())

    def window(self) -> float | None:
        """Samples/s over the steps since the previous call (or since warm-up ended); None while
        warming up. Starts a new window."""
        if self._mark is None:
            return None
        now = self._clock()
        steps0, t0 = self._mark
        self._mark = (self.steps, now)
        n = self.steps - steps0
        return n * self.samples_per_step / (now - t0) if n > 0 and now > t0 else None

    def finish(self) -> None:
        self._t_end = self._clock()

    @property
    def samples_per_s(self) -> float | None:
        """Over every step after warm-up (None before ``finish``, or with no step after warm-up)."""
        if self._t_end is None or self._t_warm is None:
            return None
        n = self.steps - self.warmup_steps
        elapsed = self._t_end - self._t_warm
        return n * self.samples_per_step / elapsed if n > 0 and elapsed > 0 else None

    @property
    def elapsed_s(self) -> float:
        """Wall seconds from ``start()`` to ``finish()``, warm-up included (0 before both)."""
        if self._t_end is None or self._t_start is None:
            return 0.0
        return self._t_end - self._t_start

    @property
    def warmup_s(self) -> float | None:
        """Wall seconds of the warm-up steps; None while they run."""
        if self._t_warm is None or self._t_start is None:
            return None
        return self._t_warm - self._t_start

    def record(self) -> dict[str, Any]:
        """The result line's fields: ``warmup_s``, ``warmup_steps``."""
        warm = self.warmup_s
        return {"warmup_s": round(warm, 3) if warm is not None else None, "warmup_steps": self.warmup_steps}


def human(value: float, unit: str) -> str:
    """A rate as people read it: ``20,670 samples/s``, ``52.3 samples/s``, ``0.412 samples/s``."""
    if value >= 100:
        return f"{value:,.0f} {unit}"
    if value >= 10:
        return f"{value:,.1f} {unit}"
    return f"{value:.3g} {unit}"


def progress_fields(fields: dict[str, Any]) -> str:
    """A progress line's status: ``loss=2.345  20,670 samples/s  414,000 tokens/s  MFU 26.1%``;
    rates that are None (warm-up) read ``warming up``."""
    parts = []
    for key, value in fields.items():
        if key in ("samples_per_s", "tokens_per_s"):
            unit = key.replace("_per_s", "/s")
            parts.append("warming up" if value is None and key == "samples_per_s" else (human(value, unit) if value is not None else ""))
        elif key == "mfu":
            parts.append(f"MFU {value:.1%}" if value is not None else "")
        elif isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        else:
            parts.append(f"{key}={value}")
    return "  ".join(p for p in parts if p)
