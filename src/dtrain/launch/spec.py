"""Where and how many workers to start, validated where it is defined."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

LAUNCHERS = ("torchrun", "spawn")
DEFAULT_MULTINODE_PORT = 29500


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    nproc: int = 1
    """Worker processes on this node (``-n``)."""
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    """Address of node 0, which hosts the rendezvous; 127.0.0.1 on one node."""
    master_port: int | None = None
    """Port of the rendezvous; a free one is picked on one node when not given."""
    launcher: str = "torchrun"
    max_restarts: int = 0
    """How often torch's elastic agent restarts failed workers (torchrun launcher only)."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"-n/--nproc must be >= 1, got {self.nproc}; give the number of processes per node, e.g. -n 2.")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be >= 1, got {self.nnodes}.")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1} for --nnodes {self.nnodes}.")
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"unknown launcher {self.launcher!r}; choose one of: {', '.join(LAUNCHERS)}.")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}.")
        if self.max_restarts and self.launcher == "spawn":
            raise ConfigError("--max-restarts needs --launcher torchrun (torch.multiprocessing.spawn cannot restart workers).")
        if self.master_port is not None and not 0 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port {self.master_port} is not a TCP port; use 1024..65535.")
        if self.nnodes > 1 and not self.master_addr:
            raise ConfigError(f"--nnodes {self.nnodes} needs --master-addr, the address of node 0 that every node can reach.")

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def addr(self) -> str:
        return self.master_addr or "127.0.0.1"

    @property
    def port(self) -> int:
        if self.master_port is not None:
            return self.master_port
        return 0 if self.nnodes == 1 else DEFAULT_MULTINODE_PORT

    @property
    def needs_launch(self) -> bool:
        return self.world_size > 1 or self.max_restarts > 0
