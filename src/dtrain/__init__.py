"""dtrain: take a PyTorch training script from one process to many, and measure which way is best.

    import dtrain
    ctx = dtrain.init(strategy="ddp", precision="bf16-mixed")
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.setup_dataloader(loader)
"""

from .context import Context, DtrainModule, DtrainOptimizer
from .startup import init, seed_everything
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

__version__ = "0.1.0"

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
    "seed_everything",
    "__version__",
]
