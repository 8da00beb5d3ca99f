"""Horovod Elastic (``hvd.elastic``) on torch's elastic agent (docs/compat.md). The agent restarts
every worker on a failure or a change of nodes, so every commit is also written to the node's disk
(commits.py) and ``run`` starts each worker from the newest commit any node holds.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch

from dtrain import preempt
from dtrain.world.sources import TorchrunEnv

from .. import _basics
from .. import _ops as ops
from .._engine import HorovodInternalError, HostsUpdatedInterrupt, MismatchError
from .commits import CommitStore, folder_from_env
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState, get_handler_registry, set_handler_registry

#: Exit status of a worker that stops so the agent restarts it from the last commit.
RESTART_EXIT = 75


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for the elastic training function ``func(state, ...)``, called on every rank:
    starts (or resumes) from the newest commit, synchronised over every rank, and stops this
    worker for a restart when a peer fails or the launcher asks workers to stop."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        installed = preempt.install((signal.SIGTERM,))
        try:
            _begin(state)
            result = func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:
            if state._commits is None:
                raise
            _stop(state, "the launcher asked the workers to stop (a node joins or leaves, or the job is stopping)",
                  128 + (preempt.received() or signal.SIGTERM), loud=False)
        except MismatchError:
            raise  # the script's own bug: a restart would meet it again
        except HorovodInternalError as exc:
            if state._commits is None:
                raise  # no launcher to restart this process: Horovod's error stands
            _stop(state, f"a collective failed ({str(exc).splitlines()[0][:200]})", RESTART_EXIT, loud=True)
        finally:
            held = preempt.received()
            if installed:
                preempt.uninstall()
        if state._commits is not None:
            state._commits.close()  # the training is over: no restart resumes from here
        if installed and held:
            os.kill(os.getpid(), held)  # a stop signal that came after the last commit still stops
        return result

    return wrapper


def _begin(state: State) -> None:
    """Resume from the newest commit any node holds (a restarted worker), then ``sync()``."""
    folder = folder_from_env()
    store = state._commits = CommitStore(folder, writer=_basics.local_rank() == 0) if folder else None
    numbers = ops.allgather(torch.tensor([store.latest() if store else -1], dtype=torch.int64))
    newest = int(numbers.max())
    root = 0
    if newest >= 0:
        root = int((numbers == newest).nonzero()[0])
        if _basics.rank() == root:
            saved = store.load()  # type: ignore[union-attr]
            state.load_snapshot(saved["state"])
            print(f"dtrain: hvd.elastic: rank {root} resumes from commit {newest} (made on {saved['size']} "
                  f"process(es), now {_basics.size()})", file=sys.stderr, flush=True)
        state._number = newest
        state.on_reset()
    state.sync(root)
    state.save()  # the synchronised state is the one restore() rolls back to


def _stop(state: State, why: str, code: int, loud: bool) -> None:
    """Make the last commit durable and end this worker, so that the agent restarts it."""
    store = state._commits
    assert store is not None
    written = store.flush() if store.writer else state._number
    if loud or _basics.rank() == 0:
        restarts = TorchrunEnv.restarts_left()
        if code != RESTART_EXIT:
            after = ""
        elif restarts <= 0:
            after = "; no restarts left, so the job ends (dtrain run --max-restarts K allows K)"
        else:
            after = "; the workers start again from there"
        print(f"dtrain: hvd.elastic: rank {_basics.rank()} stops at commit {written if written > 0 else 'none'}: "
              f"{why}{after}.", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)  # not sys.exit: after a failed collective the interpreter's exit can hang


__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "get_handler_registry", "run", "set_handler_registry"]
