"""Where each step's time goes on this rank (docs/observability.md), by a lap timer: each mark
ends the running lap and books it to a phase. Backward's compute ends at an autograd final
callback queued as backward starts, so before DDP's: what ``backward()`` takes after it is exposed
communication. On a GPU each lap records a CUDA event, resolved only when a window is read.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .meters import DataWait

PHASES = ("data_wait", "forward", "backward", "comm", "optimizer", "rest")
"""The phases of a step, in order; ``step`` is their sum."""
SCHEDULE = "schedule"
"""A pipeline step's interleaved forward, backward and sends, timed as one lap (those are None)."""
_COLUMNS = (*PHASES, SCHEDULE)
_FOLDED = {"checkpoint": "rest", "start": "rest"}
"""Laps with their own name (for traces) that the breakdown counts as ``rest``."""


class StepBreakdown:
    """This rank's per-step phase times (ms). ``enabled=False`` makes every mark but the data
    wait's a no-op."""

    def __init__(self, device: torch.device | str = "cpu", *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.data = DataWait()
        self._cuda = torch.device(device).type == "cuda"
        self._laps: list[tuple[str, float, Any]] | None = None
        self._compute_ended = False
        self._pending: list[list[tuple[str, float, Any]]] = []
        self._window: list[tuple[float, ...]] = []
        self._all: list[tuple[float, ...]] = []
        self.steps = 0
        """Steps closed so far."""
        self.listeners: list[Callable[[int, list[tuple[str, float, float]]], None]] = []
        """Called with (step index, host spans [(phase, start s, end s)]) as each step closes (traces)."""

    # -- marks ------------------------------------------------------------------------------
    def step_starts(self) -> None:
        """The previous step (if any) ends; this one starts by waiting for its batch."""
        self.data.ready()
        if not self.enabled:
            self._laps = None
            return
        if self._laps is not None:
            self.lap("rest")
            self._close()
        self._laps = [("start", time.perf_counter(), self._event())]

    def finish(self) -> None:
        """The last step ends (no new one starts)."""
        if self._laps is not None:
            self.lap("rest")
            self._close()

    def got_batch(self) -> None:
        self.data.got_batch()
        self.lap("data_wait")

    def lap(self, phase: str) -> None:
        """The running lap ends now and counts as ``phase``."""
        if self._laps is not None:
            self._laps.append((phase, time.perf_counter(), self._event()))

    def backward_starts(self, loss: torch.Tensor) -> None:
        """Forward ends; arranges for the end of backward's compute to be marked."""
        if self._laps is None:
            return
        self.lap("forward")
        self._compute_ended = False
        if loss.requires_grad and loss.grad_fn is not None:
            loss.register_hook(self._queue_compute_end)

    def backward_done(self) -> None:
        if self._laps is None:
            return
        self.lap("comm" if self._compute_ended else "backward")
        self._compute_ended = False

    def _queue_compute_end(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._compute_end)

    def _compute_end(self) -> None:
        self.lap("backward")
        self._compute_ended = True

    def _event(self) -> Any:
        if not self._cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _close(self) -> None:
        laps, self._laps = self._laps, None
        if laps is None or len(laps) < 2:
            return
        if self.listeners:
            spans = [(laps[i][0], laps[i - 1][1], laps[i][1]) for i in range(1, len(laps))]
            for fn in self.listeners:
                fn(self.steps, spans)
        self.steps += 1
        self._pending.append(laps)

    # -- reading ----------------------------------------------------------------------------
    def _resolve(self) -> None:
        """Turn closed steps' laps into rows of phase times (waits for their CUDA events)."""
        for laps in self._pending:
            if self._cuda and laps[-1][2] is not None:
                laps[-1][2].synchronize()
            ms = dict.fromkeys(_COLUMNS, 0.0)
            for (_, t0, e0), (phase, t1, e1) in zip(laps, laps[1:]):
                if e0 is not None and phase != "data_wait":
                    d = e0.elapsed_time(e1)
                else:
                    d = (t1 - t0) * 1e3
                ms[_FOLDED.get(phase, phase)] += d
            row = tuple(ms[p] for p in _COLUMNS)
            self._window.append(row)
            self._all.append(row)
        self._pending = []

    def window(self) -> dict[str, Any] | None:
        """``stats`` of the steps closed since the last call (``own``: the step less exposed
        communication); then a new window. None when no step closed."""
        self._resolve()
        rows, self._window = self._window, []
        return stats(rows)

    def reset(self) -> None:
        """Forget the steps closed so far (e.g. warm-up steps)."""
        self._resolve()
        self._window, self._all = [], []

    def recent(self, n: int) -> dict[str, Any] | None:
        """The same figures over the last ``n`` steps closed (the log interval's window stays)."""
        self._resolve()
        return stats(self._all[-n:]) if n > 0 else None

    def summary(self) -> dict[str, Any] | None:
        """The same figures over every step of the run, the first apart (it starts the loader)."""
        self._resolve()
        return stats(self._all[1:] or self._all)


def stats(rows: list[tuple[float, ...]]) -> dict[str, Any] | None:
    """``{"steps": n, "median_ms": {phase: ...}, "p90_ms": {phase: ...}}`` with ``step`` and ``own``;
    for staged steps (pipeline) ``schedule`` holds forward, backward and comm, which are None."""
    if not rows:
        return None
    rows = [(*r, *[0.0] * (len(_COLUMNS) - len(r))) for r in rows]  # rows of PHASES alone: no schedule lap
    staged = any(r[_COLUMNS.index(SCHEDULE)] > 0 for r in rows)
    cols = {p: [r[i] for r in rows] for i, p in enumerate(_COLUMNS) if staged or p != SCHEDULE}
    cols["step"] = [sum(r) for r in rows]
    cols["own"] = [sum(r) - r[PHASES.index("comm")] for r in rows]
    unknown = STAGED_UNKNOWN if staged else ()
    out = {"steps": len(rows),
           "median_ms": {k: None if k in unknown else round(statistics.median(v), 3) for k, v in cols.items()},
           "p90_ms": {k: None if k in unknown else round(p90(v), 3) for k, v in cols.items()}}
    if staged:
        out["note"] = STAGED_NOTE
    return out


STAGED_UNKNOWN = ("forward", "backward", "comm", "own")
STAGED_NOTE = ("pipeline: forward, backward and the sends between stages run interleaved inside the schedule and are "
               "timed together as 'schedule'; forward, backward, comm and own are unknown (null)")


def p90(values: list[float]) -> float:
    """The 90th percentile (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, -(-9 * len(s) // 10) - 1))]


STAT_KEYS = (*PHASES, "step", "own", SCHEDULE)


def pack(window: dict[str, Any] | None) -> list[float]:
    """A window as a flat list (medians, then p90s, then the step count) for one all_gather;
    an unknown or absent figure travels as NaN."""
    if window is None:
        return [float("nan")] * (2 * len(STAT_KEYS)) + [0.0]
    def num(v: Any) -> float:
        return float("nan") if v is None else float(v)
    return ([num(window["median_ms"].get(k)) for k in STAT_KEYS] + [num(window["p90_ms"].get(k)) for k in STAT_KEYS]
            + [float(window["steps"])])


def unpack(values: list[float]) -> dict[str, Any] | None:
    n = len(STAT_KEYS)
    if not values[-1]:
        return None
    staged = not math.isnan(values[STAT_KEYS.index(SCHEDULE)])
    keys = [k for k in STAT_KEYS if staged or k != SCHEDULE]
    def fig(v: float) -> float | None:
        return None if math.isnan(v) else round(v, 3)
    out = {"steps": int(values[-1]),
           "median_ms": {k: fig(values[STAT_KEYS.index(k)]) for k in keys},
           "p90_ms": {k: fig(values[n + STAT_KEYS.index(k)]) for k in keys}}
    if staged:
        out["note"] = STAGED_NOTE
    return out
