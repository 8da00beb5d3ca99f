"""Naming a rank that is consistently slower than the others, and why.

DDP's all-reduce evens out every rank's step time: a rank with slow input or slow compute makes
the others wait in their gradient communication, so step times alone cannot name it. What a
rank does not spend waiting, its *own* time (the step less exposed communication, see
``breakdown.py``), can: the straggler's is long, the others' short. Its cause is the group of
phases where its own time exceeds the others' median most: input (data wait), compute
(forward, backward, optimizer step) or other (the rest of the loop).

A slow link is not named per rank: a ring all-reduce waits for its slowest link on every rank
alike, so it shows as exposed communication on all ranks (the breakdown's ``comm``), not as one
rank's own time.

Pure logic: rank 0 feeds it every rank's breakdown window (``breakdown.window``), gathered once
per log interval by the loop.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

CAUSES = {"input": ("data_wait",), "compute": ("forward", "backward", "optimizer"), "other": ("rest",)}
LABELS = {"input": "data wait", "compute": "compute (forward+backward+optimizer)", "other": "time outside the phases"}
HINTS = {
    "input": "input-bound; more --num-workers or faster storage",
    "compute": "compute-bound; a slower or busier device: other processes on its cores, clocks, thermal limits",
    "other": "the loop's own work: logging, checkpoint saves, Python overhead",
}


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    window: int = 50
    """Steps compared at a time (``--straggler-window``); checked at the log interval that completes them."""
    threshold: float = 1.3
    """A rank whose own step time is this many times the other ranks' median is named (``--straggler-threshold``)."""
    min_excess_ms: float = 1.0
    """...and exceeds it by at least this much (sub-millisecond steps jitter by their whole length)."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ConfigError(f"--straggler-window must be >= 1 step, got {self.window}.")
        if not self.threshold > 1.0:
            raise ConfigError(f"--straggler-threshold must be > 1 (a ratio to the median step), got {self.threshold}; e.g. 1.3.")


class StragglerDetector:
    """Collects per-rank windows; every ``config.window`` steps names the ranks that were slow."""

    def __init__(self, config: StragglerConfig, hosts: list[str]) -> None:
        self.config = config
        self.hosts = hosts
        self._intervals: list[list[dict[str, Any] | None]] = []
        self._steps = 0

    def add(self, step: int, per_rank: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
        """One log interval's windows (index = rank); the stragglers found when a window of
        steps is complete (an empty list otherwise, and always on a healthy run)."""
        if len(per_rank) < 2 or per_rank[0] is None:
            return []
        self._intervals.append(per_rank)
        self._steps += per_rank[0]["steps"]
        if self._steps < self.config.window:
            return []
        intervals, steps = self._intervals, self._steps
        self._intervals, self._steps = [], 0
        return self._judge(step, intervals, steps)

    def _judge(self, step: int, intervals: list[list[dict[str, Any] | None]], steps: int) -> list[dict[str, Any]]:
        n = len(intervals[0])
        # Own time as the sum of the groups' medians (not the median of own times), so that the
        # groups' excesses add up to the rank's excess and the largest names its cause.
        own = [sum(_median_of(intervals, r, phases) for phases in CAUSES.values()) for r in range(n)]
        found = []
        for r in range(n):
            others = statistics.median([own[q] for q in range(n) if q != r])
            if own[r] < self.config.threshold * others or own[r] - others < self.config.min_excess_ms:
                continue
            excess = {}
            for cause, phases in CAUSES.items():
                mine = _median_of(intervals, r, phases)
                theirs = statistics.median([_median_of(intervals, q, phases) for q in range(n) if q != r])
                excess[cause] = (mine - theirs, mine, theirs)
            cause = max(excess, key=lambda c: excess[c][0])
            _, mine, theirs = excess[cause]
            ratio = own[r] / others if others > 0 else float("inf")
            line = (f"straggler: rank {r} (host {self.hosts[r]}) took {ratio:.1f}x the median step for the last {steps} steps: "
                    f"{LABELS[cause]} {mine:.1f} ms vs {theirs:.1f} ms median ({HINTS[cause]})")
            found.append({"step": step, "rank": r, "host": self.hosts[r], "ratio": round(ratio, 3), "cause": cause,
                          "cause_ms": round(mine, 3), "median_ms": round(theirs, 3), "window_steps": steps, "line": line})
        return found


def _median_of(intervals: list[list[dict[str, Any] | None]], rank: int, phases: tuple[str, ...]) -> float:
    """The median over intervals of this rank's summed phase medians (intervals it had no step in skipped)."""
    values = [sum(w["median_ms"][p] for p in phases) for w in (iv[rank] for iv in intervals) if w is not None]
    return statistics.median(values) if values else 0.0
