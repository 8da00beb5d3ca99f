"""Strategies: how a model and its optimizer are spread over the ranks. One module per method, each
a ``ParallelDims`` preset through the one apply path; ``build`` is the only way to get one, so no
code outside this package branches on a strategy's name.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

from .._log import note_once
from ..comm import CommSpec
from ..errors import ConfigError
from ..parallel.dims import ParallelDims, resolve
from .base import Capabilities, Strategy

_REGISTRY: dict[str, Callable[..., Strategy]] = {}


def register(name: str, *, capabilities: Capabilities | None = None) -> Callable[[Callable[..., Strategy]], Callable[..., Strategy]]:
    """Decorator of a strategy class, or of a function that builds one (``capabilities``: what
    it declares): make it available to ``build(name)``."""

    def deco(factory: Callable[..., Strategy]) -> Callable[..., Strategy]:
        if capabilities is not None:
            factory.capabilities = capabilities  # type: ignore[attr-defined]
        _REGISTRY[name] = factory
        return factory

    return deco


def available() -> list[str]:
    return sorted(_REGISTRY)


def _factory(name: str) -> Callable[..., Strategy]:
    """The registered factory of a resolved ``name``; ConfigError lists what exists."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(available())}.")
    return factory


def declared(name: str, *, distributed: bool = True) -> Capabilities:
    """What the strategy called ``name`` declares, without building it; ConfigError lists what exists."""
    return _factory(resolve_name(name, distributed=distributed)).capabilities


def resolve_name(name: str, *, distributed: bool) -> str:
    """``auto`` is ``ddp`` with several processes and ``single`` with one; other names as given."""
    if name == "auto":
        return "ddp" if distributed else "single"
    return name


def build(name: str | Strategy, *, comm: CommSpec | None = None, distributed: bool = True,
          parallel: str | dict | ParallelDims | None = None, **options: Any) -> Strategy:
    """The strategy called ``name`` (``auto`` resolved by ``distributed``) with its options, or the
    layout ``parallel`` (``name`` auto or composed); ``comm`` goes where ``comm_options`` says."""
    if parallel is not None:
        if not isinstance(name, str) or name not in ("auto", "composed"):
            raise ConfigError(f"parallel={resolve(parallel)} and strategy={name!r} both say how to split the ranks; drop one "
                              "(a strategy name is a layout: ddp = all dp_replicate, fsdp = all dp_shard, pipeline = pp).")
        name, options = "composed", {**options, "parallel": parallel}
    if not isinstance(name, str):  # built by the caller, with its own options
        if comm_options(name, comm, distributed=distributed):
            note_once(f"--comm {comm} is not applied to a strategy passed as an object; build it with comm=... instead.")
        return name
    name = resolve_name(name, distributed=distributed)
    factory = _factory(name)
    strategy = _make(name, factory, options)
    extra = comm_options(strategy, comm, distributed=distributed)
    return _make(name, factory, {**options, **extra}) if extra else strategy


def preset(name: str, size: int, local_size: int) -> ParallelDims:
    """The layout the strategy called ``name`` takes on ``size`` processes, ``local_size`` a node:
    the registry's one map from a name to its preset, read by the plan and the CLI."""
    from ..world import World

    return build(name, distributed=size > 1).layout(World(size=size, local_size=local_size))


def _make(name: str, factory: Callable[..., Strategy], options: dict[str, Any]) -> Strategy:
    try:
        return factory(**options)
    except TypeError as exc:
        bad = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
        if bad is None and "takes no arguments" not in str(exc):
            raise
        unknown = bad.group(1) if bad else ", ".join(sorted(options))
        known = option_names(factory)
        if not known:
            raise ConfigError(f"strategy {name!r} has no option {unknown} (it takes none); drop it, or choose a strategy "
                              f"that has it, one of: {', '.join(available())}.") from None
        raise ConfigError(f"strategy {name!r} has no option {unknown}; its options are: {', '.join(known)}.") from None


def option_names(factory: Callable[..., Strategy]) -> list[str]:
    """A factory's keyword parameters and its config class's fields (for an unknown option's message)."""
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        params = inspect.signature(factory).parameters
        config = typing.get_type_hints(target).get("config")
    except (TypeError, ValueError, NameError):
        return []
    names = {p.name for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "config"}
    for cls in typing.get_args(config) or ((config,) if config is not None else ()):
        if dataclasses.is_dataclass(cls):
            names |= {f.name for f in dataclasses.fields(cls)}
    return sorted(names)


def comm_options(strategy: str | Strategy, comm: CommSpec | None, *, distributed: bool) -> dict[str, CommSpec]:
    """The strategy options that carry ``--comm``, the one place its rule lives: a method goes to a
    strategy that supports it, is a note with one process, and a ConfigError elsewhere."""
    if comm is None or comm.kind == "none":
        return {}
    if isinstance(strategy, str):
        name, capabilities = resolve_name(strategy, distributed=distributed), declared(strategy, distributed=distributed)
    else:
        name, capabilities = strategy.name, strategy.capabilities
    if capabilities.supports_comm:
        return {"comm": comm}
    if not distributed:
        note_once(f"--comm {comm} has no effect with one process (nothing to communicate).")
        return {}
    raise ConfigError(f"--comm {comm} works with the ddp strategy, not {name!r}; use --strategy ddp or --comm none.")


# Importing the modules registers them.
from . import composed, ddp, dp, fsdp, hvd, pipeline, single, zero1  # noqa: E402,F401  # isort: skip

__all__ = ["Capabilities", "Strategy", "available", "build", "comm_options", "declared", "preset", "register", "resolve_name"]
