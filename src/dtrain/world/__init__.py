"""Where this process runs: rank, local rank, world size, device and backend, detected once
(``World.detect()``: sources.py per launcher, device.py); everything else takes a ``World``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from . import sources
from .device import check_device, default_backend, pick_device, usable_devices
from .group import destroy_process_group, init_process_group, release_at_exit
from .netif import use_route_interface
from .slurm import expand_hostlist

__all__ = ["World", "WorldView", "check_device", "default_backend", "destroy_process_group", "expand_hostlist", "init_process_group",
           "release_at_exit", "usable_devices", "use_route_interface"]


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
        """Read the launcher's environment once (``sources.SOURCES``: torchrun first, then SLURM,
        else one process) and pick the device: ``device``, else the GPU of the local rank, else the CPU."""
        fields = sources.detect(os.environ if env is None else env)
        dev = pick_device(device, fields.get("local_rank", 0))
        return cls(**fields, device=dev, backend=backend or default_backend(dev))


class WorldView:
    """``rank``, ``world_size`` and ``is_main`` read from ``self.world``: the topology that what holds
    a World shows (``Context``, ``comm.Collectives``), written once."""

    world: World

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def is_main(self) -> bool:
        return self.world.is_main
