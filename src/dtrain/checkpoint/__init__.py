"""Checkpoint storage: atomic writes, checksums, retention, safe loads, and the full training state."""

from .io import atomic_save, safe_load
from .manager import CheckpointManager, RunState, load_into, rng_state, set_rng_state
from .store import list_checkpoints, read_latest
from .validate import Verdict, newest_valid, read_checkpoint, resolve, verify

__all__ = [
    "CheckpointManager", "RunState", "atomic_save", "list_checkpoints", "load_into", "read_checkpoint", "read_latest",
    "Verdict", "newest_valid", "resolve", "rng_state", "safe_load", "set_rng_state", "verify",
]
