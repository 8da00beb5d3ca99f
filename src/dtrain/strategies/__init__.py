"""Strategies: how a model and its optimizer are spread over the ranks.

One module per method, each small; ``build(name)`` is the only way to get one, so no code
outside this package branches on a strategy's name.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ..errors import ConfigError
from .base import Strategy

_REGISTRY: dict[str, Callable[..., Strategy]] = {}


def register(name: str) -> Callable[[Callable[..., Strategy]], Callable[..., Strategy]]:
    """Class decorator: make a strategy available to ``build(name)``."""

    def deco(factory: Callable[..., Strategy]) -> Callable[..., Strategy]:
        _REGISTRY[name] = factory
        return factory

    return deco


def available() -> list[str]:
    return sorted(_REGISTRY)


def build(name: str | Strategy, **options) -> Strategy:
    """Build the strategy called ``name`` with its options; ConfigError lists what exists."""
    if not isinstance(name, str):
        return name
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(available())}.")
    try:
        return factory(**options)
    except TypeError as exc:
        bad = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
        if bad is None:
            raise
        raise ConfigError(f"strategy {name!r} has no option {bad.group(1)!r}; drop it, or see the strategy's config "
                          f"class (e.g. dtrain.strategies.ddp.DDPConfig) for the options it takes.") from None


# Importing the modules registers them.
from . import ddp, dp, fsdp, hvd, pipeline, single, zero1  # noqa: E402,F401
from . import composed  # noqa: E402,F401  (after fsdp: it reuses fsdp's functions)

__all__ = ["Strategy", "available", "build", "register"]
