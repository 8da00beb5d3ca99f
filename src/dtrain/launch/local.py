"""Run a function on N local processes (``run_distributed(body, *args, world_size=2)``: one result
per rank; ``body`` module-level, its result picklable): what `dtrain plan`'s profiles, `dtrain
doctor`'s probe and the multi-process tests run on. Each rank is a spawned process (with
``DTRAIN_LOCAL_START=forkserver``, a fork of a server that imported torch once) with the
environment ``dtrain run`` gives its workers, the store hosted by the caller on loopback. A rank
that raises fails the call with every failing rank's traceback; a hang fails it after ``timeout``.
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from .store import host_store


class DistributedTestError(AssertionError):
    """One or more ranks failed or hung. ``causes``: each failed rank's exception in one line."""

    def __init__(self, message: str, causes: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.causes = dict(causes or {})

    def first_cause(self) -> str:
        """The first failed rank and its exception, e.g. ``rank 0: RuntimeError: ...``."""
        if not self.causes:
            return str(self).strip().splitlines()[0] if str(self).strip() else type(self).__name__
        rank = min(self.causes)
        return f"rank {rank}: {self.causes[rank]}"


def exception_line(trace: str) -> str:
    """The exception of a formatted traceback: its last non-empty line (``Type: message``)."""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no traceback"


def worker_env(rank: int, local_rank: int, size: int, local_size: int, node_rank: int, addr: str, port: int) -> dict[str, str]:
    """The variables torchrun gives a worker, for one the launcher starts itself (a client of its store)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(size), "LOCAL_WORLD_SIZE": str(local_size),
            "GROUP_RANK": str(node_rank), "MASTER_ADDR": addr, "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}


_START = os.environ.get("DTRAIN_LOCAL_START", "spawn")
"""How ranks start: ``spawn``, or ``forkserver`` (forks of one server that imported torch once)."""
if _START == "forkserver":
    mp.set_forkserver_preload(["torch", "torch.distributed", "dtrain"])


def _child(rank: int, world_size: int, port: int, env: dict[str, str], fn: Callable[..., Any], args: tuple, results: Any) -> None:
    faulthandler.enable()  # a rank killed by a signal says where it was
    if _START == "forkserver":
        os.environ.clear()  # a fork of the server: the caller's environment, as spawn would give it
    os.environ.update(env)
    os.environ.update(worker_env(rank, rank, world_size, world_size, 0, "127.0.0.1", port))
    try:
        value = fn(*args)
        # As bytes: a tensor in a queue is a shared-memory handle that dies with this process.
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, SystemExit included, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        from ..world import destroy_process_group

        destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return each rank's return value, by rank."""
    ctx = mp.get_context(_START)
    results = ctx.Queue()
    store, port = host_store("127.0.0.1", 0)
    child_env = {**(os.environ if _START == "forkserver" else {}), "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, child_env, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    shortened = died = False
    try:
        while len(outcome) < world_size and (left := deadline - time.monotonic()) > 0:
            try:
                rank, ok, value = results.get(timeout=min(left, 0.5))
                outcome[rank] = (ok, value)
            except queue.Empty:
                if all(procs[r].exitcode is not None for r in range(world_size) if r not in outcome):
                    died = True
                    break  # the rest died without reporting
            if not shortened and any(not ok for ok, _ in outcome.values()):
                # One rank failed: its peers are likely stuck in a collective; give them 10 s.
                deadline, shortened = min(deadline, time.monotonic() + 10), True
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        del store
    failures = [f"rank {r} raised:\n{v}" for r, (ok, v) in sorted(outcome.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcome]
    if missing:
        codes = ", ".join(f"rank {r}: exit {procs[r].exitcode}" for r in missing)
        failures.append(f"ranks {missing} exited without a result ({codes})." if died
                        else f"ranks {missing} did not finish within {timeout:.0f} s ({codes}); killed.")
    causes = {r: exception_line(v) for r, (ok, v) in outcome.items() if not ok}
    causes.update({r: f"exited with status {procs[r].exitcode} without a result" for r in missing})
    if failures:
        raise DistributedTestError("\n".join(failures), causes)
    return [torch.load(io.BytesIO(outcome[r][1]), weights_only=False) for r in range(world_size)]


__all__ = ["DistributedTestError", "exception_line", "run_distributed", "worker_env"]
