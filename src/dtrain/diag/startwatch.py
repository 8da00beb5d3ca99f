"""The start-up watch: a peer killed before the first collective leaves the workers nothing to
notice, and torch would wait for the store's timeout (30 minutes: pytorch/pytorch#111646). In an
elastic job it reads torch's rendezvous state once a second and ends the worker with ``LOST_EXIT``
when a node of this round is lost; in every job, start-up that outlives three
``--startup-timeout``s and a margin ends with ``STALL_EXIT``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import sys
import time
from collections.abc import Iterator
from typing import Any

from .watchdog import STALL_EXIT, DaemonThread

LOST_EXIT = 76
"""Exit status of a worker that left a round whose node was lost during start-up (the agent restarts it)."""
DEFAULT_STARTUP_S = 120.0
#: Each agent's keep-alive in an elastic job's rendezvous: a node silent for KEEP_ALIVE_S x
#: KEEP_ALIVE_ATTEMPTS seconds is dead (torch's defaults, 5 s x 3, kept survivors waiting 15 s).
KEEP_ALIVE_S = 1
KEEP_ALIVE_ATTEMPTS = 5
_POLL_S = 1.0


class StartWatch(DaemonThread):
    """Watches one worker's start-up (see the module's docstring); ``stop()`` once the group formed."""

    def __init__(self, world: Any, *, startup_s: float, elastic: str | None, dead_after_s: float) -> None:
        super().__init__("dtrain-startwatch")
        self.world = world
        self.deadline = time.monotonic() + 3 * startup_s + 30.0
        self.startup_s = startup_s
        self.dead_after_s = dead_after_s
        self._elastic = elastic

    def _run(self) -> None:
        backend = _rendezvous_backend(self._elastic) if self._elastic else None
        first: tuple[int, dict] | None = None
        while not self._stop.wait(_POLL_S):
            if time.monotonic() > self.deadline:
                self._end(STALL_EXIT, f"start-up did not end within {3 * self.startup_s + 30:g} s (three "
                                      f"--startup-timeout waits of {self.startup_s:g} s and a margin); see the output above")
            if backend is None:
                continue
            state = read_state(backend)
            if state is None:
                continue
            if first is None:
                first = (state.round, dict(state.participants))
                continue
            lost = self._lost(state, *first)
            if lost and not self._stop.is_set():
                self._end(LOST_EXIT, lost)

    def _lost(self, state: Any, round_: int, participants: dict) -> str | None:
        return lost_node(state, round_, participants, self.dead_after_s, "while the process group was forming")

    def _end(self, code: int, why: str) -> None:
        if self.world.local_rank == 0:
            tail = "; this node's workers restart and the job goes on without it" if code == LOST_EXIT else ""
            print(f"dtrain: error: node {self.world.node_rank}: {why}{tail}.", file=sys.stderr, flush=True)
        os._exit(code)


def lost_node(state: Any, round_: int, participants: dict, dead_after_s: float, when: str) -> str | None:
    """What lost a node of round ``round_`` (its ``participants``) in the rendezvous ``state``, or
    None: the round moved on, a participant left, or one has been silent for ``dead_after_s``."""
    if state.round != round_:
        return f"the rendezvous moved on to round {state.round} {when} (this node's round: {round_})"
    now = datetime.datetime.now(datetime.timezone.utc)
    for node in participants:
        beat = state.last_heartbeats.get(node)
        if node not in state.participants or beat is None:
            return f"node {_addr(node)} left the rendezvous (lost or stopped) {when}"
        silent = (now - beat).total_seconds()
        if silent > dead_after_s:
            return f"node {_addr(node)} was lost {when} (no keep-alive for {silent:.0f} s)"
    return None


def dead_after_s() -> float:
    """Seconds of silence after which a node is dead to torch's rendezvous (and to dtrain's watches)."""
    return KEEP_ALIVE_S * KEEP_ALIVE_ATTEMPTS + 2.0


def _addr(node: Any) -> str:
    return f"{getattr(node, 'addr', node)}"


def _rendezvous_backend(elastic: str) -> Any:
    """A client of the job's c10d rendezvous store (``run_id@host:port``), or None when unreachable."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    run_id, _, endpoint = elastic.rpartition("@")
    host, _, port = endpoint.rpartition(":")
    try:
        store = dist.TCPStore(host.strip("[]"), int(port), None, False, datetime.timedelta(seconds=10))
        return C10dRendezvousBackend(store, run_id)
    except Exception:  # noqa: BLE001 -- no watch then; the bounded waits still end start-up
        return None


def read_state(backend: Any) -> Any:
    try:
        got = backend.get_state()
        return pickle.loads(got[0]) if got else None  # torch's own _RendezvousState, as its handler reads it
    except Exception:  # noqa: BLE001 -- a store going down, or another torch's state: read again next time
        return None


@contextlib.contextmanager
def start_watch(world: Any, elastic: str | None, startup_s: float) -> Iterator[None]:
    """Watch this worker's start-up while the block runs (a distributed world only)."""
    if not world.distributed:
        yield
        return
    watch = StartWatch(world, startup_s=startup_s, elastic=elastic,
                       dead_after_s=dead_after_s()).start()
    try:
        yield
    finally:
        watch.stop()
