"""How the ranks are split: one value (as torchtitan's ``ParallelDims``) that builds the one
``DeviceMesh``, outermost first ``pp, dp_replicate, dp_shard, tp``: TP ranks are neighbours (a
node's GPUs, where per-layer all-reduces are cheapest), stages the farthest apart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, first_line

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
"""The mesh's dimension names, outermost first."""

@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Degrees of each parallelism; their product is the number of processes."""

    dp_replicate: int = 1
    """Model replicas whose gradients are all-reduced (DDP)."""
    dp_shard: int = 1
    """Ranks that shard parameters, gradients and optimizer state (FSDP); with ``dp_replicate``
    > 1 too, each replica is sharded (HSDP)."""
    tp: int = 1
    """Ranks that split each layer's weights (tensor parallelism, Megatron-LM style)."""
    pp: int = 1
    """Pipeline stages the model is cut into."""

    def __post_init__(self) -> None:
        for name in DIMS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--parallel {name}={value!r} must be a whole number >= 1; e.g. {name}=2.")

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, n) for n in DIMS)

    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas that each read their own share of the data."""
        return self.dp_replicate * self.dp_shard

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in DIMS)

    def __str__(self) -> str:
        used = [f"{n}={getattr(self, n)}" for n in ("dp_replicate", "dp_shard", "tp", "pp") if getattr(self, n) > 1]
        return ",".join(used) or "dp_replicate=1"

    def check_world(self, world_size: int) -> None:
        """ConfigError with the arithmetic unless the degrees multiply to ``world_size``."""
        if self.world_size == world_size:
            return
        terms = " x ".join(f"{n}={getattr(self, n)}" for n in ("dp_replicate", "dp_shard", "tp", "pp") if getattr(self, n) > 1) or "1"
        others = self.tp * self.pp * self.dp_replicate  # the data-parallel degree that fits the rest, when one does
        fix = (f" (e.g. dp_shard={world_size // others} with the rest as given)" if world_size % others == 0
               else f", or start {self.world_size} processes")
        raise ConfigError(f"--parallel {self}: {terms} = {self.world_size} processes, but the job has {world_size}; "
                          f"make the product {world_size}{fix}.")

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (row-major over ``DIMS``, tp fastest)."""
        out: dict[str, int] = {}
        for name in reversed(DIMS):
            size = getattr(self, name)
            out[name], rank = rank % size, rank // size
        return out

    def dp_rank(self, rank: int) -> int:
        """Which data shard ``rank`` reads: ranks that differ only in tp or pp read the same."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def build_mesh(self, device_type: str, backend: str = "") -> Any:
        """The one ``DeviceMesh`` of shape (pp, dp_replicate, dp_shard, tp), named by ``DIMS``: the
        only place dtrain builds one. Collective: call on every rank."""
        from torch.distributed.device_mesh import init_device_mesh

        try:
            return init_device_mesh(device_type, self.shape(), mesh_dim_names=DIMS)
        except (RuntimeError, NotImplementedError, ValueError) as exc:  # a backend without n-D meshes
            first = first_line(exc)
            shape = "x".join(str(n) for n in self.shape())
            raise ConfigError(f"--parallel {self}: torch cannot build a {shape} device mesh on backend {backend or device_type} "
                              f"({first}); use a layout of fewer dimensions (e.g. --strategy fsdp).") from None


def parse(text: str) -> ParallelDims:
    """``dp_shard=2,tp=2`` -> ParallelDims; ConfigError naming the bad part."""
    values: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in DIMS:
            raise ConfigError(f"--parallel {text!r}: {part!r} is not NAME=N with NAME one of {', '.join(DIMS)}; write e.g. --parallel dp_shard=2,tp=2.")
        if key in values:
            raise ConfigError(f"--parallel {text!r} names {key} twice ({key}={values[key]} and {part}); give each name once.")
        try:
            values[key] = int(value)
        except ValueError:
            raise ConfigError(f"--parallel {text!r}: {key}={value!r} is not a whole number; write e.g. {key}=2.") from None
    if not values:
        raise ConfigError(f"--parallel {text!r} names no dimension; write e.g. --parallel dp_shard=2,tp=2.")
    return ParallelDims(**values)


def resolve(value: str | Mapping[str, int] | ParallelDims) -> ParallelDims:
    """A ParallelDims from its text (``dp_shard=2,tp=2``), a dict, or itself."""
    if isinstance(value, ParallelDims):
        return value
    if isinstance(value, str):
        return parse(value)
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(DIMS))
        if unknown:
            raise ConfigError(f"parallel={dict(value)!r} has unknown dimension(s) {', '.join(map(str, unknown))}; use {', '.join(DIMS)}.")
        return ParallelDims(**value)
    raise ConfigError(f"parallel={value!r} is a {type(value).__name__}; give a dict such as {{'dp_shard': 2, 'tp': 2}} or text 'dp_shard=2,tp=2'.")
