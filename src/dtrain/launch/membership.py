"""A node that leaves an elastic job (``--nnodes MIN:MAX``) without ending it.

torch's launcher ends its agent with ``rdzv_handler.shutdown()``, which *closes* the c10d
rendezvous for every node (torch/distributed/launcher/api.py, ``launch_agent``; only an agent
ended by torch's own ``SignalException`` skips it, and then the others wait for its keep-alive
to expire, 15 s by default). dtrain's launcher owns the stop signals (supervise.py), so it
decides here: a node whose launcher was told to stop *leaves*: it takes itself out of the
round's participants (the step torch's handler runs itself before each new round) and stops
its heartbeats, so the other nodes' next round forms at once, without it. A node whose workers
finished closes the rendezvous as before (the job is done).

The handler is torch's own c10d one, created through a backend registered under
``BACKEND`` so that this launcher holds it; nothing of the rendezvous is re-implemented. Taking
a node out of the participants uses torch's private ``_RendezvousExitOp``: where a torch
version lacks it, the node still leaves without closing, and the others wait for its
keep-alive to expire instead.
"""

from __future__ import annotations

import time
from typing import Any

from .._log import logger

BACKEND = "dtrain-c10d"
_LEAVE_TIMEOUT_S = 10.0

_handler: Any = None
"""The rendezvous handler of this launcher's elastic agent (one job per launcher process)."""


def _create(params: Any) -> Any:
    global _handler
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    # It is torch's c10d rendezvous, and says so: the registry checks that the handler's backend
    # name is the one the parameters ask for (RendezvousHandlerRegistry.create_handler).
    params.backend = "c10d"
    backend, store = create_backend(params)
    _handler = create_handler(store, backend, params)
    return _handler


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
