"""The samples ledger as a listener (``--ledger DIR``): each committed step's samples are
written down, so a check can prove every sample was trained on exactly once per epoch."""

from __future__ import annotations

from typing import Any

from . import Listener, LoopState


class LedgerListener(Listener):
    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger
        """A ``dtrain.data.ledger.SampleLedger`` (``begin(step)``, ``commit(step)``)."""

    def on_start(self, state: LoopState) -> None:
        self.ledger.begin(state.step)  # after the resume: the steps after it of earlier attempts no longer count

    def on_step(self, state: LoopState) -> None:
        self.ledger.commit(state.step)
