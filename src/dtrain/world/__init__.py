"""Where this process runs: rank, local rank, world size, device and backend, detected once.

``World.detect()`` is the only place in dtrain that reads the launcher's environment
(torchrun / ``dtrain run``, SLURM, or none). Everything else takes a ``World``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, LaunchError
from .slurm import SlurmStep, expand_hostlist, master_address

__all__ = ["World", "default_backend", "destroy_process_group", "expand_hostlist", "init_process_group"]

@dataclass(frozen=True, kw_only=True)
class World:
    """The topology of one process, as a single explicit value."""

    rank: int = 0
    """Global rank of this process, 0 .. size-1."""
    local_rank: int = 0
    """Rank among the processes of this node; picks the GPU."""
    size: int = 1
    """Number of processes in the job."""
    local_size: int = 1
    """Number of processes on this node."""
    node_rank: int = 0
    """Index of this node, 0 .. num_nodes-1."""
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    source: str = "single"
    """Who started the process: 'torchrun' (includes ``dtrain run``), 'slurm' or 'single'."""
    device: torch.device = torch.device("cpu")
    backend: str = "gloo"
    restart_count: int = 0
    """How many times the elastic agent has restarted the workers (0 on the first attempt)."""
    agent_store: bool = False
    """The launcher's agent hosts the rendezvous store; workers connect to it as clients."""
    slurm_job_id: int | None = None
    """The SLURM job this process belongs to (also under ``srun dtrain run``); None outside SLURM."""
    requeue_count: int = 0
    """How often SLURM has requeued the job (``SLURM_RESTART_COUNT``); > 0 means: resume."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"world size must be >= 1, got {self.size}.")
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"rank {self.rank} is outside the world of size {self.size}; give a rank in 0..{self.size - 1}.")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def num_nodes(self) -> int:
        return max(1, self.size // max(1, self.local_size))

    @classmethod
    def detect(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        device: str | torch.device | None = None,
        backend: str | None = None,
    ) -> World:
        """Read the launcher's environment once: torchrun first, then SLURM, else one process."""
        env = os.environ if env is None else env
        step = SlurmStep.from_env(env)
        if "RANK" in env and "WORLD_SIZE" in env:
            fields = _from_torchrun(env)
        elif step is not None and step.ntasks > 1:
            fields = _from_slurm(step, env)
        else:
            fields = {"source": "single"}
        if env.get("SLURM_JOB_ID"):
            fields["slurm_job_id"] = _int(env, "SLURM_JOB_ID")
            fields["requeue_count"] = _int(env, "SLURM_RESTART_COUNT", 0)
        dev = _pick_device(device, fields.get("local_rank", 0))
        return cls(**fields, device=dev, backend=backend or default_backend(dev))

    def with_device(self, device: str | torch.device) -> World:
        dev = torch.device(device)
        return replace(self, device=dev, backend=default_backend(dev))


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None:
        if default is None:
            raise ConfigError(f"environment variable {key} is not set; start the job with `dtrain run`.")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {key}={raw!r} is not an integer.") from None


def _from_torchrun(env: Mapping[str, str]) -> dict:
    size = _int(env, "WORLD_SIZE")
    local_size = _int(env, "LOCAL_WORLD_SIZE", size)
    return {
        "rank": _int(env, "RANK"),
        "local_rank": _int(env, "LOCAL_RANK", 0),
        "size": size,
        "local_size": local_size,
        "node_rank": _int(env, "GROUP_RANK", _int(env, "RANK") // max(1, local_size)),
        "master_addr": env.get("MASTER_ADDR", "127.0.0.1"),
        "master_port": _int(env, "MASTER_PORT", 0),
        "source": "torchrun",
        "restart_count": _int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        "agent_store": env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    }


def _from_slurm(step: SlurmStep, env: Mapping[str, str]) -> dict:
    """One SLURM task per process (``srun -n N python train.py``): the step gives every rank."""
    step.check_gpus(1, how="one task per process")
    return {
        "rank": step.procid,
        "local_rank": step.localid,
        "size": step.ntasks,
        "local_size": step.tasks_on_node,
        "node_rank": step.node_id,
        "master_addr": master_address(step, env),
        "master_port": _int(env, "MASTER_PORT", step.default_port),
        "source": "slurm",
    }


def _pick_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    if device is not None:
        return check_device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def usable_devices() -> list[str]:
    """The device types this torch build can train on here."""
    found = ["cpu"]
    for kind in ("cuda", "xpu", "mps"):
        module = getattr(torch, kind, None) if kind != "mps" else getattr(torch.backends, "mps", None)
        try:
            if module is not None and module.is_available():
                found.append(kind)
        except Exception:  # a broken driver counts as absent; World.detect reports what is there
            pass
    return found


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device, if this machine has it; else one ConfigError line."""
    usable = usable_devices()
    if not isinstance(device, (str, torch.device)) or isinstance(device, bool):
        raise ConfigError(f"device {device!r} is of type {type(device).__name__}; give a string such as {' or '.join(usable)}.")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"device {str(device)!r} is not a device type torch knows; use one of: {', '.join(usable)}.") from None
    if dev.type not in usable:
        why = "CUDA is not available" if dev.type == "cuda" else f"this machine has no {dev.type} device dtrain can use"
        raise ConfigError(f"device {str(dev)!r} requested but {why}; use one of: {', '.join(usable)}.")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device {str(dev)!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                          f"numbered 0..{torch.cuda.device_count() - 1}; pick one of those.")
    if dev.type == "cpu" and dev.index not in (None, 0):
        raise ConfigError(f"device {str(dev)!r}: the CPU has no index; use cpu.")
    return dev


def init_process_group(world: World, timeout_s: float = 1800.0, startup_s: float | None = None) -> bool:
    """Join the default process group described by ``world``; no-op for one process.

    Collective: call on every rank. Returns True when this call created the group. Each start-up
    wait (store connect, the group's forming, the first collective) is bounded by ``startup_s``
    (default: ``timeout_s``) and ends in one LaunchError line naming who did not come (issue 29);
    the group's collectives then get ``timeout_s``.
    """
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
        # The agent's store outlives restarts; a prefix per attempt keeps the workers of a
        # restart from reading the addresses their dead predecessors published there (torch's
        # env:// handler assumes a fresh store per attempt, which the static rendezvous reuses).
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
    use_route_interface(world.master_addr, quiet=not world.is_main)
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
    """One barrier within the start-up bound: a rank that formed the group but never reaches a
    collective (its node lost meanwhile) is named here rather than in the first step, 30 minutes on."""
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


def _versions() -> dict[str, str]:
    import platform
    import socket

    from .._version import __version__

    return {"dtrain": __version__, "torch": torch.__version__, "python": platform.python_version(), "host": socket.gethostname()}


def _check_same_versions(world: World) -> None:
    """Raise LaunchError on a rank whose dtrain, torch or Python version differs from rank 0's.

    ``dtrain run`` compares the nodes before starting workers; this covers jobs started by
    torchrun or srun. Two store operations per rank, no collective: a rank with another torch
    fails here, at once, instead of in the first mismatched collective.
    """
    try:
        store = dist.PrefixStore("/dtrain/versions", dist.distributed_c10d._get_default_store())
    except Exception:  # a private torch API; without it the check is skipped
        return
    mine = _versions()
    if world.rank == 0:
        store.set("0", json.dumps(mine))
        return
    theirs = json.loads(store.get("0"))
    for key in ("dtrain", "torch", "python"):
        if mine[key] != theirs[key]:
            raise LaunchError(
                f"ranks run different {key} versions: rank {world.rank} ({mine['host']}) has {mine[key]}, rank 0 "
                f"({theirs['host']}) has {theirs[key]}; install the same version on every node."
            )


def use_route_interface(master_addr: str, *, quiet: bool = False) -> dict[str, str]:
    """Point gloo's and NCCL's sockets at the interface that routes to ``master_addr`` (the
    loopback interface for a loopback master) unless the user chose one (see ``dtrain.world.netif``);
    returns the variables set in this process."""
    from .._log import logger
    from .netif import is_loopback, socket_env

    chosen = socket_env(master_addr, os.environ)
    os.environ.update(chosen)
    if chosen and not quiet and not is_loopback(master_addr):
        names = ", ".join(f"{k}={v}" for k, v in chosen.items())
        logger.info(f"sockets between nodes use the interface that routes to {master_addr}: {names} (set them yourself to choose another)")
    return chosen


_exit_cleanup_registered = False
_ddp_at_exit: weakref.WeakSet = weakref.WeakSet()


def release_at_exit(ddp: torch.nn.Module) -> None:
    """Drop ``ddp``'s hold on its process group at exit, if it is still alive then.

    For DDP objects dtrain does not free itself (``Context.close`` does, for its own): an apex-
    or torchrun-style script keeps its DDP model in a global until the interpreter ends, even
    after its own ``destroy_process_group()``, and the group it holds can then abort the process
    (see ``_register_exit_cleanup``). Dropping the reducer, its logger and the group reference at
    exit made the abort go away: 0 of 30 runs of such a script here, against 3 of 16 without.
    """
    _ddp_at_exit.add(ddp)
    _register_exit_cleanup()


def _register_exit_cleanup() -> None:
    """At exit, collect garbage and leave the group while the interpreter is still whole.

    A DDP module that is still alive when the process ends can abort it at exit ("terminate
    called without an active exception"): seen here with torch 2.13 + gloo in 3 of 30 runs of a
    plain torchrun DDP script, and in 0 of 30 once the DDP object was freed before
    destroy_process_group (see also pytorch/pytorch#179291). ``Context.close`` frees dtrain's DDP
    wrappers first; this handler covers scripts that never call it.
    """
    global _exit_cleanup_registered
    if not _exit_cleanup_registered:
        import atexit
        import gc

        def cleanup() -> None:
            for ddp in list(_ddp_at_exit):
                for name in ("reducer", "logger", "process_group"):
                    ddp.__dict__.pop(name, None)
            gc.collect()
            destroy_process_group()

        atexit.register(cleanup)
        _exit_cleanup_registered = True


_left_groups: list[Any] = []


def destroy_process_group() -> None:
    """Leave the default process group if one exists.

    The groups' Python objects are kept until the interpreter ends, so that the last reference
    to a group is not dropped by one of its backend's own threads (say, a comm hook's future
    callback, which holds the group, finishing on a gloo worker after the main thread has moved
    on): the backend's destructor joins its worker threads, and on one of them that join aborts
    the process ("Resource deadlock avoided"). One CI run saw that abort once, on a rank after
    a PowerSGD run; 10 reruns did not, so this path is a likely cause, not a proven one. Each
    group is shut down here as before; only its memory waits.
    """
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a private map; without it, nothing is kept
            _left_groups.extend(dist.distributed_c10d._world.pg_map)
        dist.destroy_process_group()


def _bracket(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
