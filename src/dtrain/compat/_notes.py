"""Notes the compat layer says once per process, on dtrain's logger (compat uses only the public API)."""

from __future__ import annotations

import logging

_said: set[str] = set()


def note_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logging.getLogger("dtrain").warning(message)
