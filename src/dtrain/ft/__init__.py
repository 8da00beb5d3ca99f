"""Per-step fault tolerance on torchft (``dtrain train --fault-tolerance``; an optional extra, ``dtrain[ft]``).

A job is a set of replica groups (one process each, or a node's processes with the model sharded
over them by FSDP, ``group.py``) that replicate the model. torchft's Lighthouse forms a quorum of the live groups before every step; the gradients are averaged over
the quorum on a gloo group reconfigured in place; only a committed step moves the optimizer and
the data. A group that is lost leaves the quorum (the others go on without a restart); one that
comes back heals from a live peer's memory (torchft's checkpoint transport). See
docs/fault-tolerance.md.
"""

from .launch import start
from .spec import FaultTolerance, FaultToleranceStopped

__all__ = ["FaultTolerance", "FaultToleranceStopped", "start"]
