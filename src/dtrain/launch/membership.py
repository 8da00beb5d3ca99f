"""A node that leaves an elastic job (``--nnodes MIN:MAX``) without ending it.

torch's launcher ends its agent with ``rdzv_handler.shutdown()``, which *closes* the c10d
rendezvous for every node. Here a node that was told to stop, or whose agent failed, *leaves*
instead: it takes itself out of the round's participants (torch's private ``_RendezvousExitOp``)
and stops its heartbeats, so the others' next round forms at once without it. A node whose
workers finished closes the rendezvous as before (the job is done). The handler is torch's own
c10d one, created through a backend registered under ``BACKEND`` so that this launcher holds it.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from .._log import logger
from ..diag.startwatch import KEEP_ALIVE_ATTEMPTS, KEEP_ALIVE_S, dead_after_s, lost_node, read_state  # noqa: F401 -- KEEP_ALIVE_*: the rendezvous options (runner.py)
from .preflight import Notes, wait_for_master

BACKEND = "dtrain-c10d"
_LEAVE_TIMEOUT_S = 10.0
_BARRIER_POLL_S = 0.5

_handler: Any = None
"""The rendezvous handler of this launcher's elastic agent (one job per launcher process)."""


def _create(params: Any) -> Any:
    global _handler
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    params.backend = "c10d"  # torch's registry checks the handler's backend name against the parameters
    backend, store = _c10d_backend(params)
    _handler = create_handler(store, backend, params)
    _handler._dtrain_backend = backend  # the exit barrier reads the rendezvous state through it
    _leave_if_lost(_handler)
    _say_while_gathering(_handler, params)
    return _handler


def _say_while_gathering(handler: Any, params: Any) -> None:
    """While torch's rendezvous waits for MIN nodes (without a word), progress lines at preflight.Notes' rate."""
    gather = handler.next_rendezvous
    join_s = params.get_as_int("join_timeout", 600)

    def note(done: threading.Event) -> None:
        notes, start = Notes(), time.monotonic()
        while not done.wait(0.5):
            elapsed = time.monotonic() - start
            if not notes.due(elapsed):
                continue
            state = read_state(handler._dtrain_backend)
            joined = len(state.participants) if state is not None and not state.complete else None
            if joined is not None and joined < params.min_nodes:
                logger.info(f"waiting for {params.min_nodes - joined} more node(s) at {params.endpoint} ({elapsed:.0f} s "
                            f"of {join_s} s): {joined} of --nnodes {params.min_nodes}:{params.max_nodes} joined the rendezvous")

    def next_rendezvous() -> Any:
        done = threading.Event()
        threading.Thread(target=note, args=(done,), name="dtrain-rdzv-notes", daemon=True).start()
        try:
            return gather()
        finally:
            done.set()

    handler.next_rendezvous = next_rendezvous


#: Handlers of agents that failed in this launcher: kept, since the first one may own the
#: rendezvous store that the next agent of this node (and every other node) still uses.
_kept: list[Any] = []
_hosted: dict[tuple[str, int], Any] = {}
#: Keys the host's store opens with (LaunchSpec.store_values, set by the launcher for the job at hand).
posted: tuple[tuple[str, str], ...] = ()


def lost_in_rendezvous(exc: BaseException) -> bool:
    """Whether an agent's failure is a store wait that a lost node left unanswered (torch's
    DistStoreError / the c10d rendezvous' connection error), not a timeout waiting for MIN nodes."""
    name = type(exc).__name__
    return name in ("DistStoreError", "RendezvousConnectionError", "RendezvousStateError") or (
        isinstance(exc, RuntimeError) and "wait timeout" in str(exc))


def finished_without_this_node(exc: BaseException) -> bool:
    """Whether an agent's failure is a *closed* rendezvous: in a dtrain job only a node whose
    workers finished closes it (a failed or stopped node leaves instead), so the job is done."""
    return type(exc).__name__ == "RendezvousClosedError"


def join_timed_out(me: str, endpoint: str, min_nodes: int, max_nodes: int | None, waited_s: float) -> str:
    """The one line for torch's RendezvousTimeoutError (it carries no message)."""
    return (f"node {me} waited {waited_s:g} s at the rendezvous {endpoint} and no round formed with it: --nnodes "
            f"{min_nodes}:{max_nodes} needs {min_nodes} node(s) to start (a running job takes one more up to {max_nodes}); "
            "start the other node(s) with the same --nnodes, --master-addr, --master-port and --rdzv-id, or raise "
            "--rdzv-timeout (default: --startup-timeout).")


def _leave_if_lost(handler: Any) -> None:
    """An agent that failed leaves rather than closes the rendezvous (its close would end the job of
    the nodes still training); only a node whose workers finished closes it."""
    close = handler.shutdown

    def shutdown() -> bool:
        exc = sys.exc_info()[1]  # what the agent is failing with, if anything (torch calls this in `finally`)
        if exc is not None:
            _kept.append(handler)
            return _leave(handler)
        return close()

    handler.shutdown = shutdown


def _c10d_backend(params: Any) -> tuple[Any, Any]:
    """torch's c10d backend on a TCPStore that dtrain opens: the host's listens on the endpoint's
    address only (torch's binds every interface); a client's connect is bounded and fails in one line."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from ..errors import LaunchError
    from ..world.reach import unreachable_cause
    from .store import host_store

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout_s = params.get_as_int("read_timeout", 60)
    if (host, port) in _hosted:  # this launcher's earlier agent hosts it; the job's state lives there
        store = _hosted[(host, port)]
    elif params.get_as_bool("is_host"):
        store, _ = host_store(host, port, timeout_s=timeout_s)
        _hosted[(host, port)] = store
        for key, value in posted:  # --parallel auto's pick (launch/autopick.py), before any node can look
            store.set(key, value)
    else:
        me = f"node {params.local_addr or 'this node'}"
        # Polled first: torch's client retries a refused connection silently, then logs C++ frames.
        wait_for_master(host, port, timeout_s=timeout_s, me=me, what="the rendezvous store",
                        fix="start the first node (the one at --master-addr) with the same --master-port")
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as exc:
            cause = unreachable_cause(host, here_is_master=False)
            raise LaunchError(f"{me} could not connect to the rendezvous store at {host}:{port} within {timeout_s} s: "
                              f"{cause} (is the first node's launcher running? --startup-timeout bounds this wait; "
                              f"torch: {str(exc).splitlines()[0][:120]})") from None
    return C10dRendezvousBackend(store, params.run_id), store


def register() -> str:
    """Make ``BACKEND`` known to torch's rendezvous registry (idempotent); returns its name."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create)
    return BACKEND


def leave_when_shut_down() -> None:
    """From now on, this node's agent leaves the rendezvous when it ends, rather than closing it."""
    handler = _handler
    if handler is None or getattr(handler, "_dtrain_leaving", False):
        return
    handler._dtrain_leaving = True
    handler.shutdown = lambda: _leave(handler)  # what torch's launch_agent calls on its way out


def _leave(handler: Any) -> bool:
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + _LEAVE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 -- a private API, or the endpoint's node is gone already
        logger.debug(f"leaving the rendezvous: {type(exc).__name__}: {exc}; the others wait for this node's keep-alive to expire")
    stop = getattr(handler, "_stop_heartbeats", None)
    if callable(stop):
        stop()
    return True


def forget() -> None:
    """Drop the handler of a launch that ended (a later launch in this process creates its own)."""
    global _handler
    _handler = None
    _kept.clear()
    _hosted.clear()


def agent_class() -> type:
    """torch's LocalElasticAgent with an exit barrier that stops waiting for a node lost after its
    workers finished (torch's waits its whole ``exit_barrier_timeout``, 300 s). It checks in on
    torch's own barrier keys and between polls reads the rendezvous state: a node of the round that
    left or went silent past torch's expiry ends the wait with one line."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.utils import store as store_util

    class Agent(LocalElasticAgent):
        def _exit_barrier(self) -> None:
            backend = getattr(self._worker_group.spec.rdzv_handler, "_dtrain_backend", None)
            nonblocking = getattr(store_util, "_barrier_nonblocking", None)
            prefix = getattr(api, "_TERMINAL_STATE_SYNC_ID", None)
            if backend is None or nonblocking is None or prefix is None:  # a static job, or a torch without them
                return super()._exit_barrier()
            first = read_state(backend)
            nodes = self._worker_group.group_world_size
            if first is not None and len(first.participants) < nodes:  # one left already (expired, or stopped)
                print(f"dtrain: {nodes - len(first.participants)} node(s) of this round left the rendezvous after this "
                      "node's workers finished; this node does not wait for them.", file=sys.stderr, flush=True)
                return None
            key = nonblocking(self._store, nodes, prefix)
            deadline = time.monotonic() + self._exit_barrier_timeout
            while time.monotonic() < deadline:
                try:
                    if self._store.check([key]):
                        return
                except Exception:  # noqa: BLE001 -- the store is gone (its host ended): nobody left to wait for
                    return
                time.sleep(_BARRIER_POLL_S)
                now = read_state(backend)
                lost = first is not None and now is not None and lost_node(
                    now, first.round, dict(first.participants), dead_after_s(), "after this node's workers finished")
                if lost:
                    print(f"dtrain: {lost}; this node does not wait for it.", file=sys.stderr, flush=True)
                    return
            print(f"dtrain: the other nodes did not finish within {self._exit_barrier_timeout:g} s of this one; "
                  "this node ends.", file=sys.stderr, flush=True)
            return None

    return Agent
