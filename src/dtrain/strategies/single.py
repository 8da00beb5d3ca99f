"""One process, no communication: the reference every other strategy is measured against.

Its layout is the default (every rank a replica: ``dp_replicate=1`` in one process; under a
launcher of several, each rank trains on its own share of the data, as ``dtrain.compat.horovod``
uses it), and its way of replicating is the default: the model on the device, nothing shared.
"""

from __future__ import annotations

from . import register
from .base import Capabilities, Strategy


@register("single")
class SingleStrategy(Strategy):
    name = "single"
    capabilities = Capabilities()
