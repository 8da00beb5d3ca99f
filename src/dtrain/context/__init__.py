"""What a training script holds: the ``Context`` face (core.py) and its parts: the step (backward,
accumulate, clip), labelled collectives (``dtrain.comm.collectives``), exact-once evaluation, start-up
(``dtrain.init``) and preemption."""

from . import preempt
from .core import Context, DtrainModule, DtrainOptimizer

__all__ = ["Context", "DtrainModule", "DtrainOptimizer", "preempt"]
