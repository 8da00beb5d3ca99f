"""The gloo group a replica group averages its gradients over with the others' (torchft reconfigures
it in place at every new quorum), with its start bounded apart from its collectives.

torchft's ``ProcessGroupGloo`` takes one timeout for both: reaching the quorum's store and every
member (``configure``), and each all-reduce. A member that the Lighthouse put in a quorum and that
died before it reached the store (a host killed right after it asked for a quorum: its request
stands until its heartbeat expires) never publishes its address, so each survivor waited the
whole ``step-timeout`` (30 s) in configure before the step was given up (benchmarks/ft_stall.py).
A live member reaches the store at once: every member is waiting for the quorum when it forms,
and the store's address comes with it. So configure is bounded by ``FaultTolerance.connect_s``,
the Lighthouse's own time to take a silent member for dead, and each collective by ``step-timeout``.

A member whose step failed (its all-reduce saw a peer's connection reset) leaves the collective,
but its connections to the others stay open until the next quorum reconfigures the group, and one
that waits on it for data (the next in gloo's ring) waited the whole ``step-timeout`` (30 s on the
bed, 3 hosts): ``QuorumManager`` closes the group as soon as the step failed (at the latest before
its vote), so the others' collective fails at once too. The next quorum reconfigures it: a failed vote bumps its id.
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
