"""Listeners from outside the package: ``DTRAIN_PLUGIN=MODULE`` (``dtrain.options``) makes each
worker of ``dtrain train`` import MODULE and add what its ``listeners(ctx)`` returns to the loop's
listeners. The tests' fault driver lives there (tests/support/faults.py), not in the product."""

from __future__ import annotations

import importlib
from typing import Any

from ...errors import ConfigError
from . import Listener


def plugin_listeners(module: str | None, ctx: Any) -> list[Listener]:
    """The listeners ``module`` adds for this rank (none without one)."""
    if not module:
        return []
    try:
        make = getattr(importlib.import_module(module), "listeners", None)
    except ImportError as exc:
        raise ConfigError(f"DTRAIN_PLUGIN={module!r} cannot be imported ({exc}); name a module on the workers' "
                          "Python path, or unset DTRAIN_PLUGIN.") from None
    if not callable(make):
        raise ConfigError(f"DTRAIN_PLUGIN={module!r} has no listeners(ctx) function; define one that returns a list of "
                          "dtrain.train.listeners.Listener.")
    return list(make(ctx))
