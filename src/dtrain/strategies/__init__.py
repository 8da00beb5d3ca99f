"""Strategies: how a model and its optimizer are spread over the ranks.

One module per method, each small; ``build(name)`` is the only way to get one, so no code
outside this package branches on a strategy's name.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from .._log import note_once
from ..comm import CommSpec
from ..errors import ConfigError
from .base import Capabilities, Strategy

_REGISTRY: dict[str, Callable[..., Strategy]] = {}


def register(name: str) -> Callable[[Callable[..., Strategy]], Callable[..., Strategy]]:
    """Class decorator: make a strategy available to ``build(name)``."""

    def deco(factory: Callable[..., Strategy]) -> Callable[..., Strategy]:
        _REGISTRY[name] = factory
        return factory

    return deco


def available() -> list[str]:
    return sorted(_REGISTRY)


def resolve_name(name: str, *, distributed: bool) -> str:
    """``auto`` is ``ddp`` with several processes and ``single`` with one; other names as given."""
    if name == "auto":
        return "ddp" if distributed else "single"
    return name


def build(name: str | Strategy, *, comm: CommSpec | None = None, distributed: bool = True, **options) -> Strategy:
    """Build the strategy called ``name`` (``auto`` resolved by ``distributed``) with its options;
    ConfigError lists what exists. ``comm`` (``--comm``) goes through ``comm_options``."""
    if not isinstance(name, str):  # built by the caller, with its own options
        if comm_options(name, comm, distributed=distributed):
            note_once(f"--comm {comm} is not applied to a strategy passed as an object; build it with comm=... instead.")
        return name
    name = resolve_name(name, distributed=distributed)
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(available())}.")
    options.update(comm_options(name, comm, distributed=distributed))
    try:
        return factory(**options)
    except TypeError as exc:
        bad = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
        if bad is None:
            raise
        raise ConfigError(f"strategy {name!r} has no option {bad.group(1)!r}; drop it, or see the strategy's config "
                          f"class (e.g. dtrain.strategies.ddp.DDPConfig) for the options it takes.") from None


def comm_options(strategy: str | Strategy, comm: CommSpec | None, *, distributed: bool) -> dict[str, CommSpec]:
    """The strategy options that carry ``--comm``: the one place its rule lives. A method other
    than ``none`` goes to a strategy whose capabilities support it, has no effect with one
    process (a note), and is a ConfigError on any other strategy."""
    if comm is None or comm.kind == "none":
        return {}
    if isinstance(strategy, str):
        name = resolve_name(strategy, distributed=distributed)
        factory = _REGISTRY.get(name)
        if factory is None:
            raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(available())}.")
        capabilities = factory.capabilities
    else:
        name, capabilities = strategy.name, strategy.capabilities
    if capabilities.supports_comm:
        return {"comm": comm}
    if not distributed:
        note_once(f"--comm {comm} has no effect with one process (nothing to communicate).")
        return {}
    raise ConfigError(f"--comm {comm} works with the ddp strategy, not {name!r}; use --strategy ddp or --comm none.")


# Importing the modules registers them.
from . import ddp, dp, fsdp, hvd, pipeline, single, zero1  # noqa: E402,F401  # isort: skip
from . import composed  # noqa: E402,F401  # isort: skip  (after fsdp: it reuses fsdp's functions)

__all__ = ["Capabilities", "Strategy", "available", "build", "comm_options", "register", "resolve_name"]
