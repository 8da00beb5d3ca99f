"""The gloo group a replica group averages its gradients over with the others' (torchft reconfigures
it in place at every new quorum), with its start bounded apart from its collectives.

torchft's ``ProcessGroupGloo`` takes one timeout for both reaching the quorum's members
(``configure``) and each all-reduce: a member that died after the Lighthouse put it in a quorum
never arrives, and each survivor waited the whole ``step-timeout``. A live member arrives at once,
so configure is bounded by ``FaultTolerance.connect_s`` and each collective by ``step-timeout``.
And a member whose step failed keeps its connections open until the next quorum, so a peer waiting
on it for data waited ``step-timeout`` too: ``QuorumManager`` closes the group as soon as a step failed.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
from torchft import Manager
from torchft.process_group import ProcessGroupGloo


class QuorumGroup(ProcessGroupGloo):
    """torchft's reconfigurable gloo group: ``connect`` to start it, ``step`` for each collective."""

    def __init__(self, *, connect: timedelta, step: timedelta) -> None:
        super().__init__(timeout=connect)  # torchft's configure reads it: the store's client and gloo's connect
        self._connect, self._step = connect, step

    def configure(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().configure(*args, **kwargs)
        except Exception:
            # A live member on a loaded host may be late: the next try (the next quorum) waits twice as
            # long, up to step-timeout, so a busy machine cannot fail every configure in a row.
            self._timeout = min(self._timeout * 2, self._step)
            raise
        self._timeout = self._connect

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        pg = super()._create_pg(store, rank, world_size)  # connected: every member was reached within `connect`
        pg._get_backend(torch.device("cpu")).set_timeout(self._step)  # the same backend serves cuda tensors
        return pg


class QuorumManager(Manager):
    """torchft's Manager, which closes its process group as soon as a step of this group failed."""

    def report_error(self, e: Exception) -> None:
        super().report_error(e)
        # A failed wait in the training thread (torchft's ``_ManagedWork.wait``): close at once, so that
        # the step's other all-reduces in flight (the overlapped average's buckets) fail too, instead of
        # this thread waiting on them, and on peers that wait on us, before the vote.
        if threading.current_thread() is threading.main_thread():
            self._pg.abort(errored=False)

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        if self.errored() is not None:  # an error recorded in another thread (the quorum's, a future's callback)
            self._pg.abort(errored=False)  # the others' sends and receives to us fail now, not at step-timeout
        return super().should_commit(timeout)
