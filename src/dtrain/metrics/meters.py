"""Meters: plain arithmetic over what a loop reports, no I/O."""

from __future__ import annotations

import statistics
import time


class DataWait:
    """How long each step waited for its batch. The run's first wait (the DataLoader workers
    starting) is kept apart in ``first_ms``: in a short run it would outweigh every other step."""

    def __init__(self) -> None:
        self.first_ms: float | None = None
        self.total_s = 0.0
        self.steps = 0
        self._all: list[float] = []
        self._window: list[float] = []
        self._t: float | None = None

    def ready(self) -> None:
        """The step is done; the wait for the next batch starts now."""
        self._t = time.perf_counter()

    def got_batch(self) -> None:
        if self._t is None:
            return
        ms = (time.perf_counter() - self._t) * 1000.0
        self._t = None
        if self.first_ms is None:
            self.first_ms = round(ms, 3)
            return
        self.total_s += ms / 1000.0
        self.steps += 1
        self._all.append(ms)
        self._window.append(ms)

    def window_median_ms(self) -> float | None:
        """Median wait of the steps since the last call (one log interval), then a new window."""
        window, self._window = self._window, []
        return round(statistics.median(window), 3) if window else None

    def median_ms(self) -> float | None:
        return round(statistics.median(self._all), 3) if self._all else None
