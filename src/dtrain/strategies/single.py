"""One process, no communication: the reference every other strategy is measured against (under
a launcher of several, each rank trains alone on its share, as ``dtrain.compat.horovod`` uses it).
"""

from __future__ import annotations

from . import register
from .base import Capabilities, Strategy


@register("single")
class SingleStrategy(Strategy):
    name = "single"
    capabilities = Capabilities()
