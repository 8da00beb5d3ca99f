"""What a dry run checks: `dtrain train`'s task, batch, precision and layout sections, the world
they are meant for, and which of its ranks runs here."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _check as check
from ..errors import ConfigError
from ..parallel import parse as parse_layout
from ..train.config import BatchConfig, OptimConfig, ParallelConfig, RuntimeConfig, TaskConfig

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class DryRunConfig:
    task: TaskConfig = TaskConfig()
    batch: BatchConfig = BatchConfig()
    optim: OptimConfig = OptimConfig()
    parallel: ParallelConfig = ParallelConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    """``device`` is this machine's device the rank runs on (default: cuda when there is one)."""
    world_size: int = 1
    """Processes of the world checked (``-n`` x ``--nnodes``)."""
    local_size: int = 1
    """Processes per node (``-n``): hsdp shards within a node."""
    rank: int = 0
    """The rank run here for real (``--rank``); the others are torch's fake process group."""
    steps: int = 3
    """Training steps run (``--steps``): forward, backward, optimizer."""
    device_memory: float | None = None
    """Bytes the device has (``--device-memory`` GiB); None: this device's own."""
    seed: int = 0

    def __post_init__(self) -> None:
        check.integer("-n (processes per node)", self.local_size, minimum=1)
        check.integer("the world size (-n x --nnodes)", self.world_size, minimum=1)
        check.integer("--steps", self.steps, minimum=1)
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"--rank {self.rank} is outside the world of {self.world_size} process(es); "
                              f"give a rank in 0..{self.world_size - 1}.")
        if self.device_memory is not None:
            check.number("--device-memory (GiB)", self.device_memory / GIB, positive=True)
        layout = self.parallel.layout
        if layout == "auto":
            raise ConfigError("--parallel auto: a dry run checks a layout you give; run `dtrain plan` for its pick, "
                              "then dry-run that (e.g. --parallel dp_shard=4,tp=2).")
        if layout is not None:
            dims = parse_layout(layout)
            dims.check_world(self.world_size)
            if dims.pp > 1:
                raise ConfigError(f"--parallel {dims}: a dry run does not run pipeline stages (pp>1) yet; "
                                  "check the layout without pp, or train it for real.")
        if self.parallel.strategy == "pipeline":
            raise ConfigError("--strategy pipeline: a dry run does not run pipeline stages yet; check another strategy.")
        if self.parallel.strategy in ("dp", "hvd") and self.world_size > 1:
            raise ConfigError(f"--strategy {self.parallel.strategy}: a dry run checks torch.distributed layouts "
                              "(ddp, zero1, fsdp, hsdp, --parallel); use ddp, which costs the same.")
