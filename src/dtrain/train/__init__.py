"""The ready training job behind ``dtrain train``: a config value in sections, the checks and the
start from the launching process, and the loop that runs on every rank."""

from .config import TrainConfig
from .loop import run, worker_main
from .start import start

__all__ = ["TrainConfig", "run", "start", "worker_main"]
