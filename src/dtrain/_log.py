"""dtrain's logger. Library code only logs; the CLI decides where it goes (never the root logger)."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("dtrain")
_said: set[str] = set()


def note_once(message: str) -> None:
    """Log an informational note the first time it is said in this process."""
    if message not in _said:
        _said.add(message)
        logger.warning(message)


def configure_cli_logging(rank: int, verbose: bool = False) -> None:
    """Send dtrain's log to stderr as `dtrain: ...` lines; only rank 0 speaks below ERROR."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dtrain: %(message)s" if rank == 0 else f"dtrain[rank {rank}]: %(message)s"))
    logger.handlers[:] = [handler]
    logger.propagate = False
    if rank == 0:
        logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    else:
        logger.setLevel(logging.ERROR)
