"""The exception tree. Every error a user can cause is a ``DtrainError``.

The CLI turns a ``DtrainError`` into one line on stderr and its ``exit_code``;
anything else is a bug in dtrain and keeps its traceback.

    DtrainError
    ├── ConfigError         a flag, argument or setting is invalid
    ├── DataError           a data set is missing, unreadable or malformed
    ├── LaunchError         processes could not be started or rendezvous failed
    ├── CheckpointError     a checkpoint cannot be written or read
    ├── CollectiveMismatch  ranks called different collectives
    └── StallError          a rank made no progress within the stall timeout
"""

from __future__ import annotations


class DtrainError(Exception):
    """Base of every error dtrain raises on purpose."""

    exit_code: int = 1

    def __init__(self, *args: object) -> None:
        # Raised in a DataLoader worker, it comes back rebuilt as ``type("Caught ... Original
        # Traceback ...")`` (torch's ExceptionWrapper.reraise): keep the worker's one-line message.
        if len(args) == 1 and isinstance(args[0], str) and "\nOriginal Traceback" in args[0]:
            last = args[0].rstrip().splitlines()[-1]
            args = (last.split(": ", 1)[1] if f"{type(self).__name__}: " in last else last,)
        super().__init__(*args)


class ConfigError(DtrainError):
    """An invalid flag, argument or setting; the message names the value and the fix."""

    exit_code = 2


class DataError(DtrainError):
    """A data set is missing, unreadable or malformed."""

    exit_code = 2


class LaunchError(DtrainError):
    """Workers could not be started, or a worker failed."""

    exit_code = 1


class CheckpointError(DtrainError):
    """A checkpoint cannot be written or read."""

    exit_code = 2


class CollectiveMismatch(DtrainError):
    """Ranks called different collectives (op, shape or dtype)."""

    exit_code = 1


class StallError(DtrainError):
    """A rank made no progress within the stall timeout."""

    exit_code = 1


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of ``exc``'s message (its type's name when it has none), cut at ``limit``."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:limit]
