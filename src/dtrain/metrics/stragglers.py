"""Naming a rank that is consistently slower than the others, and why (docs/observability.md).
DDP evens out step times, so a straggler is named by its *own* time (the step less exposed
communication); a slow link shows as communication dominating every rank's step, and is probed."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .breakdown import PHASES
from .links import slow_hosts

CAUSES = {"input": ("data_wait",), "compute": ("forward", "backward", "optimizer"), "other": ("rest",)}
LABELS = {"input": "data wait", "compute": "compute (forward+backward+optimizer)", "other": "time outside the phases"}
HINTS = {
    "input": "input-bound; more --num-workers or faster storage",
    "compute": "compute-bound; a slower or busier device: other processes on its cores, clocks, thermal limits",
    "other": "the loop's own work: logging, checkpoint saves, Python overhead",
    "network": "network: a slower link; check its NIC, cable and switch port, or send less with --comm bf16 or powersgd",
}


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    window: int = 50
    """Steps compared at a time (``--straggler-window``); checked at the log interval that completes them."""
    threshold: float = 1.3
    """A rank whose own step time is this many times the other ranks' median is named (``--straggler-threshold``)."""
    min_excess_ms: float = 1.0
    """...and exceeds it by at least this much (sub-millisecond steps jitter by their whole length)."""
    min_excess_share: float = 0.05
    """...and by at least this share of the median step (less does not slow the job)."""
    comm_share: float = 0.5
    """When exposed communication is at least this share of every rank's median step over a
    window (and no rank's own time stands out), the links are probed to name a slow one."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ConfigError(f"--straggler-window must be >= 1 step, got {self.window}.")
        if not (self.threshold > 1.0 and math.isfinite(self.threshold)):  # inf or nan would name no rank, ever
            raise ConfigError(f"--straggler-threshold must be > 1 (a ratio to the median step), got {self.threshold}; e.g. 1.3.")
        if not 0.0 < self.comm_share <= 1.0:
            raise ConfigError(f"comm_share must be in (0, 1], got {self.comm_share}; e.g. 0.5.")


class StragglerDetector:
    """Collects per-rank windows; every ``config.window`` steps names the ranks that were slow.
    Deterministic in what it is fed, so every rank can run one and agree on ``probe_due``."""

    def __init__(self, config: StragglerConfig, hosts: list[str]) -> None:
        self.config = config
        self.hosts = hosts
        """Each rank's host (distinct per node)."""
        self._intervals: list[list[dict[str, Any] | None]] = []
        self._steps = 0
        self.probe_due: tuple[int, int, float] | None = None
        """(step, window steps, smallest comm share) when communication dominated every rank's last window."""
        self._held: list[dict[str, Any]] = []
        """That window's own-time findings, for ``name_links`` to return if no link is slow."""

    def add(self, step: int, per_rank: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
        """One log interval's windows (index = rank); the stragglers found when a window of
        steps is complete (an empty list otherwise, and always on a healthy run)."""
        if len(per_rank) < 2 or per_rank[0] is None:
            return []
        if any(w is not None and w["median_ms"].get("own") is None for w in per_rank):
            return []  # staged steps (pipeline): a stage's own time is not told apart from its waits (breakdown.py)
        self._intervals.append(per_rank)
        self._steps += per_rank[0]["steps"]
        if self._steps < self.config.window:
            return []
        intervals, steps = self._intervals, self._steps
        self._intervals, self._steps = [], 0
        found = self._judge(step, intervals, steps)
        share = min(_median_of(intervals, r, ("comm",)) / max(_median_of(intervals, r, PHASES), 1e-9) for r in range(len(per_rank)))
        # With fewer than three hosts a probe could not name one (links.py): it is not run.
        probe = share >= self.config.comm_share and len(set(self.hosts)) >= 3
        self.probe_due = (step, steps, share) if probe else None
        if probe:
            self._held, found = found, []
        return found

    def name_links(self, ms: list[list[float]], nbytes: int) -> list[dict[str, Any]]:
        """After the probe ``probe_due`` asked for: the ranks on the host whose link is slow by
        ``ms[src][dst]``; when none stands out, the window's own-time findings."""
        assert self.probe_due is not None
        step, steps, share = self.probe_due
        self.probe_due = None
        worst: dict[str, dict[str, Any]] = {}  # per host, its slower direction
        for slow in slow_hosts(ms, self.hosts, self.config.threshold, self.config.min_excess_ms):
            slow["ratio"] = slow["ms"] / slow["others_ms"] if slow["others_ms"] > 0 else float("inf")
            if slow["host"] not in worst or slow["ratio"] > worst[slow["host"]]["ratio"]:
                worst[slow["host"]] = slow
        found = []
        for slow in worst.values():
            for r in (q for q, h in enumerate(self.hosts) if h == slow["host"]):
                ratio = slow["ratio"]
                verb = "sent" if slow["direction"] == "upload" else "received"
                line = (f"straggler: rank {r} (host {slow['host']}): every rank spent >= {share:.0%} of its step waiting in "
                        f"communication for the last {steps} steps; this host's link {verb} {nbytes / 1024:.0f} KiB in "
                        f"{slow['ms']:.1f} ms at best vs {slow['others_ms']:.1f} ms median on the other hosts' ({HINTS['network']})")
                found.append({"step": step, "rank": r, "host": slow["host"], "ratio": round(ratio, 3), "cause": "network",
                              "cause_ms": slow["ms"], "median_ms": slow["others_ms"], "direction": slow["direction"],
                              "window_steps": steps, "line": line})
        held, self._held = self._held, []
        return found or held

    def _judge(self, step: int, intervals: list[list[dict[str, Any] | None]], steps: int) -> list[dict[str, Any]]:
        n = len(intervals[0])
        # Own time as the sum of the groups' medians (not the median of own times), so that the
        # groups' excesses add up to the rank's excess and the largest names its cause.
        own = [sum(_median_of(intervals, r, phases) for phases in CAUSES.values()) for r in range(n)]
        median_step = statistics.median(_median_of(intervals, r, PHASES) for r in range(n))
        least = max(self.config.min_excess_ms, self.config.min_excess_share * median_step)
        found = []
        for r in range(n):
            others = statistics.median([own[q] for q in range(n) if q != r])
            if own[r] < self.config.threshold * others or own[r] - others < least:
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
