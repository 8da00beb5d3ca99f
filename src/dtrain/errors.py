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
