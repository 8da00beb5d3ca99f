"""What a training script holds: the ``Context`` face (core.py) and its parts: the set-up of the
model and the loader (setup.py), the step (backward, accumulate, clip), labelled collectives
(``dtrain.comm.collectives``), exact-once evaluation, the script's files (saving.py: ``ctx.save`` /
``ctx.load``), start-up (``dtrain.init``) and preemption."""

from . import preempt
from .core import Context, DtrainModule, DtrainOptimizer

__all__ = ["Context", "DtrainModule", "DtrainOptimizer", "preempt"]
