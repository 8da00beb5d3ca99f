"""What the run says as it goes: the loss averaged over each log interval and over the ranks
(``LossWindow``), and the record of each interval (``Report``: progress bar, metrics file, the
observer's breakdown, stragglers, TensorBoard and trace)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from . import Listener, LoopState


class LossWindow(Listener):
    """Every ``log_every`` steps (and at the last): ``state.last_loss``, the mean over ranks of
    the loss since the last log; the window starts again. Collective then: every rank."""

    def __init__(self, ctx: Any, log_every: int) -> None:
        self.ctx, self.log_every = ctx, log_every

    def on_step(self, state: LoopState) -> None:
        state.logged = state.step % self.log_every == 0 or state.step == state.total
        if state.logged:
            state.last_loss = self.ctx.all_reduce(state.window_loss / state.window_steps, op="mean").item()
            state.window_loss.zero_()
            state.window_steps = 0


class Report(Listener):
    """The record of each log interval, to the progress bar, the metrics file and the observer;
    the observer's per-step tick. ``rate(steps)``: samples/s so far; ``extra(samples_per_s)``: the
    task's figures derived from it (tokens/s)."""

    def __init__(self, *, observer: Any, wait: Any, t0: float, rate: Callable[[int], float | None],
                 extra: Callable[[float | None], dict[str, Any]], progress: Any = None, sink: Any = None) -> None:
        self.obs, self.wait, self.t0, self.rate, self.extra = observer, wait, t0, rate, extra
        self.progress, self.sink = progress, sink

    def on_step(self, state: LoopState) -> None:
        if state.logged:
            self.write(state)
        self.obs.tick(state.step)

    def write(self, state: LoopState) -> None:
        """Collective (the observer gathers every rank's breakdown): every rank."""
        record = {"step": state.step, "epoch": state.epoch, "train_loss": state.last_loss,
                  "samples_per_s": self.rate(state.step - state.start_step),
                  "data_wait_ms": self.wait.window_median_ms(), "wall_s": round(time.perf_counter() - self.t0, 3)}
        record.update(self.extra(record["samples_per_s"]))
        record.update(self.obs.interval(state.step, record["samples_per_s"]))
        if self.progress:
            self.progress.update(state.step, {"loss": state.last_loss, **{k: record.get(k) for k in ("samples_per_s", "tokens_per_s", "mfu")}})
        if self.sink:
            self.sink.write(record)
        self.obs.write(record)

    def on_end(self, state: LoopState) -> None:
        self.obs.close()
        if self.progress:
            self.progress.close()
