"""Meters: plain arithmetic over what a loop reports, no I/O."""

from __future__ import annotations

import time


class Throughput:
    """Samples per second over a window of steps (``perf_counter`` based)."""

    def __init__(self) -> None:
        self.samples = 0
        self.elapsed = 0.0
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self, samples: int) -> None:
        if self._t0 is not None:
            self.elapsed += time.perf_counter() - self._t0
            self.samples += samples
            self._t0 = None

    def rate_now(self, samples: int) -> float | None:
        """Samples per second since ``start`` for ``samples`` processed so far (window still open)."""
        if self._t0 is None:
            return None
        elapsed = self.elapsed + time.perf_counter() - self._t0
        return samples / elapsed if elapsed > 0 else None

    @property
    def samples_per_s(self) -> float | None:
        return self.samples / self.elapsed if self.elapsed > 0 else None
