"""Preemption as a listener: SIGUSR1/SIGTERM (caught from the run's start, ``dtrain.context.preempt``)
make every rank save at the next log interval and stop; the job is then requeued, or, in an
elastic job, the ranks whose peers leave go on in the next rendezvous round."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._log import logger
from ...context import preempt
from . import Listener, LoopState


class Preemption(Listener):
    def __init__(self, ctx: Any, log_every: int, *, elastic: bool, save: Callable[[int], None] | None = None) -> None:
        self.ctx, self.log_every, self.elastic, self.save = ctx, log_every, elastic, save
        self.signalled_here = False
        """This rank got the signal itself (not only told by its peers)."""

    def on_start(self, state: LoopState) -> None:
        if self.save is not None:  # the hook saves the step reached when it runs
            preempt.register(lambda: self.save(state.step))

    def on_step(self, state: LoopState) -> None:
        """At a log step before the last: stop if any rank was signalled. Collective then."""
        if state.step % self.log_every == 0 and state.step < state.total and preempt.check(self.ctx, announce=not self.elastic):
            state.stop, self.signalled_here = True, preempt.received() != 0

    def on_end(self, state: LoopState) -> None:
        preempt.uninstall()
        if state.stop and self.save is None:
            logger.warning("preemption: no --checkpoint-dir, so a requeued job starts again from step 0")
