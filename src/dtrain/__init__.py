"""dtrain: take a PyTorch training script from one process to many, and measure which way is best.

    import dtrain
    ctx = dtrain.init(strategy="ddp", precision="bf16-mixed")
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.setup_dataloader(loader)
"""

from ._version import __version__
from .context import Context, DtrainModule, DtrainOptimizer, preempt
from .context.startup import init, seed_everything
from .errors import (
    CheckpointError,
    CollectiveMismatch,
    ConfigError,
    DataError,
    DtrainError,
    LaunchError,
    StallError,
)
from .precision import Precision
from .tasks import Task
from .world import World

__all__ = [
    "CheckpointError",
    "CollectiveMismatch",
    "ConfigError",
    "Context",
    "DataError",
    "DtrainError",
    "DtrainModule",
    "DtrainOptimizer",
    "LaunchError",
    "Precision",
    "StallError",
    "Task",
    "World",
    "init",
    "preempt",
    "seed_everything",
    "__version__",
]
