"""The ready training job behind ``dtrain train``: a config value and the loop that runs it."""

from .config import TrainConfig
from .loop import run, worker_main

__all__ = ["TrainConfig", "run", "worker_main"]
