"""Where and how many workers to start, validated where it is defined."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _check as check
from ..errors import ConfigError

LAUNCHERS = ("torchrun", "spawn", "ray")
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
    max_nodes: int | None = None
    """``--nnodes MIN:MAX``: the job runs on ``nnodes`` (MIN) to ``max_nodes`` nodes (None: a fixed set)."""
    rdzv_id: str = "dtrain"
    """The job's name in the rendezvous (``--rdzv-id``): nodes with the same id and endpoint form one job."""
    join_timeout: float = 120.0
    """Seconds a rendezvous waits for at least MIN nodes before it fails (``--rdzv-timeout``)."""
    local_addr: str | None = None
    """The address this node advertises to the others (``--local-addr``); None: the interface's that routes to ``master_addr``."""
    startup_timeout: float = 120.0
    """Seconds each start-up wait may take (``--startup-timeout``)."""
    last_call_s: float = 5.0
    """Once MIN nodes are in, seconds to wait for more (up to MAX) before starting (``--rdzv-last-call``)."""
    ray_address: str | None = None
    """``--launcher ray``: the cluster (``--ray-address``; None: ``RAY_ADDRESS``, else one running on this machine)."""
    store_values: tuple[tuple[str, str], ...] = ()
    """Keys node 0 posts in the rendezvous store as it opens (``--parallel auto``'s pick: autopick.py)."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"-n/--nproc must be >= 1, got {self.nproc}; give the number of processes per node, e.g. -n 2.")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be >= 1, got {self.nnodes}.")
        if self.max_nodes is not None:
            self._check_elastic()
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
        check.startup_seconds("--startup-timeout", self.startup_timeout)
        if self.launcher == "ray":
            from .ray import check_launch  # Ray places the nodes: no --master-addr to ask for

            check_launch(self)
        elif self.ray_address is not None:
            raise ConfigError(f"--ray-address {self.ray_address} needs --launcher ray.")
        elif self.nnodes > 1 and not self.master_addr:
            raise ConfigError(f"--nnodes {self.nnodes} needs --master-addr, the address of node 0 that every node can reach.")

    def _check_elastic(self) -> None:
        if self.max_nodes < self.nnodes:
            raise ConfigError(f"--nnodes {self.nnodes}:{self.max_nodes} has MAX below MIN; write MIN:MAX, e.g. 1:3.")
        if not self.master_addr:
            raise ConfigError(f"--nnodes {self.nnodes}:{self.max_nodes} needs --master-addr, the address of the first node "
                              "(it hosts the rendezvous and must stay up); give the same one on every node.")
        if self.node_rank != 0:
            raise ConfigError(f"--node-rank {self.node_rank} does not go with --nnodes MIN:MAX; the rendezvous numbers the "
                              "nodes, leave --node-rank out.")
        if self.launcher != "torchrun":
            raise ConfigError("--nnodes MIN:MAX needs --launcher torchrun (torch's elastic agent).")
        check.startup_seconds("--rdzv-timeout", self.join_timeout)
        if not self.last_call_s >= 0:
            raise ConfigError(f"--rdzv-last-call must be >= 0 seconds, got {self.last_call_s:g}; e.g. --rdzv-last-call 5.")

    @property
    def elastic(self) -> bool:
        """Nodes may leave and join (``--nnodes MIN:MAX``)."""
        return self.max_nodes is not None

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
        return 0 if self.nnodes == 1 and not self.elastic else DEFAULT_MULTINODE_PORT

    @property
    def needs_launch(self) -> bool:
        # --launcher ray: on the cluster even with one worker (its GPU, its node), never in this process.
        return self.world_size > 1 or self.max_restarts > 0 or self.elastic or self.launcher == "ray"
