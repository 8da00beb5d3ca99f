"""The default process group: joined with every start-up wait bounded, checked (same versions on
every rank), and left at exit while the interpreter is still whole."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import LaunchError
from .netif import use_route_interface

if TYPE_CHECKING:
    from . import World


def init_process_group(world: World, timeout_s: float = 1800.0, startup_s: float | None = None) -> bool:
    """Join the default process group described by ``world`` (no-op for one process); True when
    this call created it. Collective. Each start-up wait is bounded by ``startup_s`` (default ``timeout_s``)."""
    from . import reach

    if not world.distributed or dist.is_initialized():
        return False
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)
    startup = min(timeout_s, startup_s) if startup_s else timeout_s
    kwargs: dict = {"backend": world.backend, "timeout": datetime.timedelta(seconds=startup), "rank": world.rank,
                    "world_size": world.size}
    store = None
    if world.source == "torchrun" and world.agent_store:
        # The agent's store outlives restarts: a prefix per attempt hides the dead predecessors' addresses.
        store = reach.connect_store(world, startup)
        kwargs["store"] = dist.PrefixStore(f"/dtrain/attempt_{world.restart_count}", store)
    elif world.source == "torchrun":
        # An elastic round: the store torch's env:// would open, but on MASTER_ADDR only.
        store = reach.worker_store(world, startup)
        kwargs["store"] = store
    else:
        kwargs["init_method"] = f"tcp://{_bracket(world.master_addr)}:{world.master_port}"
    if world.device.type == "cuda":
        kwargs["device_id"] = world.device
    use_route_interface(world.master_addr, quiet=not world.is_main, backend=world.backend)
    _register_exit_cleanup()
    if store is not None:
        reach.arrive(kwargs["store"], world)
    try:
        dist.init_process_group(**kwargs)
    except (RuntimeError, ValueError) as exc:  # c10d reports rendezvous problems as RuntimeError
        if store is not None:
            raise reach.join_failure(world, kwargs["store"], startup, exc, "the process group to form") from None
        raise LaunchError(
            f"rank {world.rank} could not join the process group at "
            f"{world.master_addr}:{world.master_port} ({exc}); check --master-addr/--master-port "
            "and that every node was started with the same --nnodes and -n."
        ) from exc
    _first_collective(world, kwargs.get("store"), startup)
    _set_timeout(datetime.timedelta(seconds=timeout_s), store)
    _check_same_versions(world)
    return True


def _first_collective(world: World, store: Any, timeout_s: float) -> None:
    """One barrier within the start-up bound: a rank lost since the group formed is named here, not in the first step."""
    from . import reach

    try:
        if world.backend == "gloo":
            # monitored_barrier names the ranks that did not come (gloo only).
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
        else:
            dist.all_reduce(torch.zeros(1, device=world.device))
    except (RuntimeError, ValueError) as exc:
        raise reach.join_failure(world, store, timeout_s, exc, "the first collective") from None


def _set_timeout(timeout: datetime.timedelta, store: Any) -> None:
    """From here on the group's collectives (and the store) wait ``timeout``, not the start-up bound."""
    setter = getattr(dist, "set_timeout", None) or getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    with contextlib.suppress(Exception):  # an old torch keeps the start-up bound
        setter(timeout)
    if store is not None:
        with contextlib.suppress(Exception):
            store.set_timeout(timeout)


def versions() -> dict[str, str]:
    """What must be the same on every rank (dtrain, torch, Python), and this host's name."""
    import platform
    import socket

    from .._version import __version__

    return {"dtrain": __version__, "torch": torch.__version__, "python": platform.python_version(), "host": socket.gethostname()}


def versions_differ(mine: dict[str, str], theirs: dict[str, str], me: str, other: str) -> LaunchError | None:
    """The LaunchError for two ``versions()`` (of ``me`` and ``other``, e.g. ``node 1``) that differ."""
    for key in ("dtrain", "torch", "python"):
        if mine[key] != theirs[key]:
            return LaunchError(f"{me.split()[0]}s run different {key} versions: {me} ({mine['host']}) has {mine[key]}, "
                               f"{other} ({theirs['host']}) has {theirs[key]}; install the same version on every node.")
    return None


def _check_same_versions(world: World) -> None:
    """Raise LaunchError on a rank whose dtrain, torch or Python version differs from rank 0's
    (through the store: a rank with another torch fails here, not in a collective)."""
    try:
        store = dist.PrefixStore("/dtrain/versions", dist.distributed_c10d._get_default_store())
    except Exception:  # a private torch API; without it the check is skipped
        return
    mine = versions()
    if world.rank == 0:
        store.set("0", json.dumps(mine))
        return
    error = versions_differ(mine, json.loads(store.get("0")), f"rank {world.rank}", "rank 0")
    if error is not None:
        raise error


_exit_cleanup_registered = False
_ddp_at_exit: weakref.WeakSet = weakref.WeakSet()


def release_at_exit(ddp: torch.nn.Module) -> None:
    """Drop ``ddp``'s hold on its process group at exit, if it is still alive then: a script that
    keeps its DDP model in a global past ``destroy_process_group()`` would abort at exit otherwise."""
    _ddp_at_exit.add(ddp)
    _register_exit_cleanup()


def _register_exit_cleanup() -> None:
    """At exit, collect garbage and leave the group while the interpreter is still whole: a live
    DDP module can abort the process at exit (pytorch/pytorch#179291) in scripts that never close."""
    global _exit_cleanup_registered
    if not _exit_cleanup_registered:
        import atexit
        import gc

        def cleanup() -> None:
            settle_backend_threads()  # before anything here can drop a group (its destructor joins them)
            for ddp in list(_ddp_at_exit):
                for name in ("reducer", "logger", "process_group"):
                    ddp.__dict__.pop(name, None)
            gc.collect()
            destroy_process_group()
            settle_backend_threads()

        atexit.register(cleanup)
        _exit_cleanup_registered = True


_BACKEND_THREADS = ("pt_gloo_runloop",)
"""Names of the backend's worker threads (gloo's, as torch names them)."""


def settle_backend_threads(limit_s: float = 2.0, look_s: float = 0.005) -> None:
    """Wait, the GIL released, until the backend's worker threads have let go of finished work: a
    gloo thread drops a finished collective's tensors (taking the GIL) after ``wait()`` returned, and
    if the interpreter finalizes first the process aborts. Sleeps until no such thread is runnable
    at two looks in a row, at most ``limit_s``."""
    deadline, quiet = time.monotonic() + limit_s, 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(look_s)
        busy = _backend_threads_busy()
        if busy is None:
            return
        quiet = 0 if busy else quiet + 1


def _backend_threads_busy() -> bool | None:
    """Whether a backend worker thread of this process is running or runnable; None off Linux."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        head, _, tail = stat.rpartition(")")  # "tid (name) state ...": the name may hold spaces or ')'
        if head.partition("(")[2] in _BACKEND_THREADS and tail[1:2] in ("R", "D"):
            return True
    return False


_left_groups: list[Any] = []


def destroy_process_group() -> None:
    """Leave the default process group if one exists. The groups' objects are kept until the end: a
    last reference dropped on a backend thread (a comm hook's callback) would join it from itself and abort."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a private map; without it, nothing is kept
            _left_groups.extend(dist.distributed_c10d._world.pg_map)
        dist.destroy_process_group()


def _bracket(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
