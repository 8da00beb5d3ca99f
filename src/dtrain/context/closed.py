"""A closed ``Context`` refuses every call in one line.

After ``ctx.close()`` the process group is gone: a collective then fails inside torch ("Default
process group has not been initialized", a traceback per rank) and a checkpoint manager has
given its folder's lock back. Each public method checks first, so a call after ``close`` says
what happened and what to do instead, on every rank alike (no collective is needed to say it).
The models and optimizers ``setup`` returned keep working, as plain local ones.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import ConfigError

T = TypeVar("T")
#: What a closed Context still does: close again (a no-op; ``__exit__`` too).
_STILL_OPEN = ("close",)


def refused_after_close(cls: type[T]) -> type[T]:
    """Class decorator: each public method of ``cls`` (properties stay readable) raises a
    ``ConfigError`` once the instance's ``_closed`` is set."""
    for name, member in list(vars(cls).items()):
        if inspect.isfunction(member) and not name.startswith("_") and name not in _STILL_OPEN:
            setattr(cls, name, _guard(name, member))
    return cls


def _guard(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise ConfigError(f"the Context was closed; ctx.{name}() needs an open one: call it before ctx.close(), "
                              "or start a new Context with dtrain.init().")
        return method(self, *args, **kwargs)

    return guarded
